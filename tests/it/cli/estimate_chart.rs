//! `oomprobe estimate --out FILE.svg|FILE.html`: the picture of the step has its series (a band
//! per role, the reserved curve, the card's usable line, the peak's label), bad paths exit 2,
//! and the HTML page renders in headless Chromium with the curve, the reserved line and the card.

use std::path::{Path, PathBuf};
use std::process::Command as Process;

use assert_cmd::Command;
use oomprobe::report::step_chart::{
    RESERVED_COLOR, RESERVED_LABEL, ROLE_COLORS, USABLE_COLOR, USABLE_LABEL,
};
use serde_json::Value;

const GPT2_ON_4090: [&str; 5] = ["estimate", "--model", "gpt2", "--gpu", "rtx4090"];

fn oomprobe() -> Command {
    Command::cargo_bin("oomprobe").unwrap()
}

fn hex(c: (u8, u8, u8)) -> String {
    format!("#{:02X}{:02X}{:02X}", c.0, c.1, c.2)
}

/// Run `estimate` for gpt2 on an RTX 4090 writing `--out path`.
fn draw(path: &Path) {
    oomprobe()
        .args(GPT2_ON_4090)
        .arg("--out")
        .arg(path)
        .assert()
        .success();
}

#[test]
fn the_svg_has_a_band_per_role_the_reserved_curve_the_usable_line_and_the_peak() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x.svg");
    draw(&path);
    let svg = std::fs::read_to_string(&path).unwrap();
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));

    let polygons: Vec<&str> = svg.lines().filter(|l| l.starts_with("<polygon")).collect();
    for (role, c) in oomprobe::plan::Role::ALL.iter().zip(ROLE_COLORS) {
        let fill = format!("fill=\"{}\"", hex((c.0, c.1, c.2)));
        assert!(
            polygons.iter().any(|p| p.contains(&fill)),
            "no band for {} ({fill})",
            role.name()
        );
        assert!(
            svg.contains(&format!("\n{}\n", role.name())),
            "legend {}",
            role.name()
        );
    }
    let stroke = |c: (u8, u8, u8)| format!("stroke=\"{}\"", hex(c));
    let polylines: Vec<&str> = svg.lines().filter(|l| l.starts_with("<polyline")).collect();
    let reserved = stroke((RESERVED_COLOR.0, RESERVED_COLOR.1, RESERVED_COLOR.2));
    // The reserved curve: a line through many points.
    assert!(
        polylines
            .iter()
            .any(|p| p.contains(&reserved) && p.matches(',').count() > 50),
        "no reserved curve"
    );
    assert!(svg.contains(RESERVED_LABEL));
    // The usable line: straight across at the card's usable bytes, and its legend with them.
    let v: Value = serde_json::from_slice(
        &oomprobe()
            .args(GPT2_ON_4090)
            .arg("--json")
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap();
    let usable = v["card_usable_bytes"].as_u64().unwrap();
    let usable_text = format!("{USABLE_LABEL}: {}", oomprobe::units::fmt_bytes(usable));
    assert!(svg.contains(&usable_text), "{usable_text}");
    let usable_stroke = stroke((USABLE_COLOR.0, USABLE_COLOR.1, USABLE_COLOR.2));
    assert!(polylines
        .iter()
        .any(|p| p.contains(&usable_stroke) && p.matches(',').count() == 2));
    // The peak, with its phase and the tensor whose allocation reached it (as --json has them).
    let phase = v["timeline"]["peak_phase"].as_str().unwrap();
    let tensor = v["timeline"]["peak_tensor"].as_str().unwrap();
    let peak = oomprobe::units::fmt_bytes(v["breakdown"]["total"].as_u64().unwrap());
    let label = format!("peak {peak} in {phase}, allocating {tensor}");
    assert!(svg.contains(&label), "no peak label '{label}'");
}

#[test]
fn a_bad_extension_or_an_unwritable_path_is_one_line_and_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    for path in [
        dir.path().join("x.png"),
        dir.path().join("no").join("such").join("x.svg"),
    ] {
        let out = oomprobe()
            .args(GPT2_ON_4090)
            .arg("--out")
            .arg(&path)
            .assert()
            .code(2)
            .get_output()
            .clone();
        let err = String::from_utf8(out.stderr).unwrap();
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(err.contains("--out"), "{err}");
        assert!(!path.exists());
    }
    // Nothing to draw with the card list.
    oomprobe()
        .args(["estimate", "--gpu", "list", "--out"])
        .arg(dir.path().join("x.svg"))
        .assert()
        .code(2);
}

/// Chromium from the distribution (scripts/test.sh installs it when missing).
fn chromium() -> PathBuf {
    let found = ["chromium", "chromium-browser", "google-chrome"]
        .iter()
        .find_map(|name| {
            std::env::var_os("PATH").and_then(|paths| {
                std::env::split_paths(&paths)
                    .map(|d| d.join(name))
                    .find(|p| p.is_file())
            })
        });
    found.unwrap_or_else(|| {
        panic!(
            "no chromium on PATH: the HTML picture is checked in a real browser; \
             install it (scripts/test.sh does: apt-get install -y chromium)"
        )
    })
}

/// Pixels of `rgb` within `tol` on each channel.
fn count(rgba: &[u8], rgb: (u8, u8, u8), tol: u8) -> usize {
    rgba.chunks_exact(4)
        .filter(|p| {
            p[0].abs_diff(rgb.0) <= tol
                && p[1].abs_diff(rgb.1) <= tol
                && p[2].abs_diff(rgb.2) <= tol
        })
        .count()
}

#[test]
fn the_html_page_renders_in_chromium_with_the_curve_the_reserved_line_and_the_card() {
    let browser = chromium();
    let dir = tempfile::tempdir().unwrap();
    let page = dir.path().join("step.html");
    draw(&page);
    // Kept under target/ so a person can look at it.
    let shot = Path::new(env!("CARGO_TARGET_TMPDIR")).join("estimate-step.png");
    let _ = std::fs::remove_file(&shot);
    let out = Process::new(&browser)
        .args([
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--window-size=1200,800",
        ])
        .arg(format!(
            "--user-data-dir={}",
            dir.path().join("profile").display()
        ))
        .arg(format!("--screenshot={}", shot.display()))
        .arg(format!("file://{}", page.display()))
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", browser.display()));
    assert!(
        shot.is_file(),
        "chromium wrote no screenshot ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );

    let decoder = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(&shot).unwrap()));
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buf).unwrap();
    assert_eq!((info.width, info.height), (1200, 800));
    let rgba: Vec<u8> = match info.color_type {
        png::ColorType::Rgba => buf[..info.buffer_size()].to_vec(),
        png::ColorType::Rgb => buf[..info.buffer_size()]
            .chunks_exact(3)
            .flat_map(|p| [p[0], p[1], p[2], 255])
            .collect(),
        other => panic!("screenshot colour type {other:?}"),
    };
    let white = count(&rgba, (255, 255, 255), 0);
    let all = rgba.len() / 4;
    assert!(
        white < all * 97 / 100,
        "blank: {white} of {all} pixels white"
    );
    // The stacked curve: the params and the optimizer bands (opaque).
    for k in [0, 2] {
        let c = ROLE_COLORS[k];
        let px = count(&rgba, (c.0, c.1, c.2), 12);
        assert!(px > 2_000, "role {k}: {px} pixels");
        eprintln!("role {k}: {px} px");
    }
    // The reserved line and the card's usable line, 2 px across most of the plot (their legend
    // swatches are 20 × 3 px).
    let reserved = count(
        &rgba,
        (RESERVED_COLOR.0, RESERVED_COLOR.1, RESERVED_COLOR.2),
        40,
    );
    assert!(reserved > 600, "reserved line: {reserved} pixels");
    let red = count(&rgba, (USABLE_COLOR.0, USABLE_COLOR.1, USABLE_COLOR.2), 40);
    assert!(red > 600, "usable line: {red} pixels");
    eprintln!(
        "screenshot {}: reserved {reserved} px, usable {red} px",
        shot.display()
    );
}
