//! `vmmu calibrate` on the terminal (the workloads are `vmmu::lab::calibrate`'s).

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

/// Whether progress should be shown (stderr is a terminal).
pub fn show_progress() -> bool {
    std::io::stderr().is_terminal()
}

/// `vmmu calibrate`'s flags.
#[derive(clap::Args)]
pub struct CalibrateArgs {
    /// The cost model file to write.
    #[arg(long, value_name = "FILE", default_value = "cost-model.json")]
    out: PathBuf,
    /// Overwrite FILE if it exists.
    #[arg(long)]
    force: bool,
    /// A fast, less precise run (a few seconds at most).
    #[arg(long)]
    quick: bool,
    /// Also print what each workload's Meter counted.
    #[arg(long)]
    counts: bool,
}

pub fn calibrate(args: &CalibrateArgs) -> ExitCode {
    if args.out.exists() && !args.force {
        eprintln!(
            "vmmu: {} already exists; pass --force to overwrite it, or --out FILE to write elsewhere",
            args.out.display()
        );
        return ExitCode::from(2);
    }
    // The file is checked before the calibration runs: a bad path fails at once, not minutes
    // later. Creating it (empty) is the check; the calibration then writes it whole, or a
    // failed calibration removes what it created.
    let created = !args.out.exists();
    if let Err(e) = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(&args.out)
    {
        eprintln!(
            "vmmu: cannot write {}: {e} (see 'vmmu calibrate --help')",
            args.out.display()
        );
        return ExitCode::from(2);
    }
    if cfg!(debug_assertions) {
        eprintln!("vmmu: calibrate: this build has debug assertions, so its timings are not a release build's; run `cargo run --release -p vmmu-cli -- calibrate`");
    }
    let sizes = if args.quick {
        vmmu::lab::calibrate::Sizes::quick()
    } else {
        vmmu::lab::calibrate::Sizes::full()
    };
    let (observations, cal) = match vmmu::lab::calibrate::run(&sizes, args.quick, show_progress()) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("vmmu: {e}");
            if created {
                let _ = std::fs::remove_file(&args.out);
            }
            return ExitCode::from(1);
        }
    };
    if let Err(e) = cal.model.save(&args.out) {
        eprintln!("vmmu: {e}");
        return ExitCode::from(1);
    }
    // A closed stdout (`| head`) must not lose the file, which is already written.
    use std::io::Write;
    let _ = writeln!(
        std::io::stdout(),
        "{}Wrote {}.",
        vmmu::lab::calibrate::report(&observations, &cal, &sizes, args.counts),
        args.out.display()
    );
    ExitCode::SUCCESS
}
