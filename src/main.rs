//! The `oomprobe` binary: parse the command line, run the command, map errors to exit codes.

use clap::Parser;
use oomprobe::cli::Cli;

fn main() {
    // Before any thread: Mesa's GL probe prints an error line without a runtime directory.
    oomprobe::backend::wgpu::quiet_mesa_runtime_dir();
    env_logger::Builder::from_env(
        env_logger::Env::default().default_filter_or("warn,wgpu_hal::gles=off"),
    )
    .init();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            use clap::error::ErrorKind;
            match e.kind() {
                ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
                    let _ = e.print();
                    std::process::exit(0);
                }
                _ => {
                    eprintln!(
                        "oomprobe: {}",
                        oomprobe::error::one_line(&oomprobe::cli::one_line_error(&e))
                    );
                    std::process::exit(2);
                }
            }
        }
    };
    if let Err(e) = oomprobe::commands::run(cli.command) {
        eprintln!("oomprobe: {}", oomprobe::error::one_line(&e.to_string()));
        std::process::exit(e.exit_code());
    }
}
