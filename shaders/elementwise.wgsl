// The entry point of every elementwise kernel (relu, gelu): Y[y_off + i] = f(X[x_off + i]) for
// i < len, one thread per element. Appended by kernels::source after the op's file, which
// defines Params and f.

@compute @workgroup_size(WG_X, WG_Y, WG_Z)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
) {
    let i = (wid.x + wid.y * nwg.x) * WG_X + lid.x;
    if (i < P.len) {
        st_y(P.y_off + i, f(ld_x(P.x_off + i)));
    }
}
