//! `rackfs`: mount RackFS, run a local cluster, see what is going on.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use rackfs_cli::args::{Cli, Cmd, Generate, GenerateCmd, QosCmd};
use rackfs_cli::error::CliError;
use rackfs_cli::up::{self, UpConfig};
use rackfs_cli::{enoteln, outln};
use rackfs_fs::mount::mount_command;

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,rackfs=info".into()),
        )
        .with_writer(std::io::stderr)
        // Colours only for a terminal: logs kept in files stay plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let result = if std::env::args_os()
        .nth(1)
        .is_some_and(|a| a == Generate::WORD)
    {
        let args = std::env::args_os().skip(1);
        generate(Generate::parse_from(args).what)
    } else {
        run(Cli::parse().cmd)
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            enoteln!("rackfs: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(cmd: Cmd) -> Result<(), CliError> {
    match cmd {
        Cmd::Up {
            dir,
            nodes,
            region,
            transport,
            detach,
            options,
            etcd,
        } => {
            // Bad options fail here, before anything starts.
            let mount = up::mount_options(&transport, &options)?;
            if detach {
                let mut fwd = vec![
                    "up".into(),
                    dir.display().to_string(),
                    "--nodes".into(),
                    nodes.to_string(),
                    "--region".into(),
                    region.to_string(),
                    "--transport".into(),
                    transport,
                    "-o".into(),
                    options,
                ];
                if etcd {
                    fwd.push("--etcd".into());
                }
                return up::up_detached(&dir, fwd);
            }
            up::up(UpConfig {
                dir,
                nodes,
                region,
                mount,
                etcd,
            })
        }
        Cmd::Down { dir } => up::down(&dir),
        Cmd::Mount {
            source,
            dir,
            options,
            foreground,
        } => {
            let exe = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("rackfs"));
            let fwd = vec![
                "mount".into(),
                "--foreground".into(),
                source.clone(),
                dir.display().to_string(),
                "-o".into(),
                options.clone(),
            ];
            if let Some(daemon) = mount_command(&source, &dir, &options, foreground, &exe, fwd)? {
                outln!("{daemon}");
            }
            Ok(())
        }
        Cmd::Qos {
            cmd: QosCmd::Set {
                mountpoint,
                settings,
            },
        } => rackfs_cli::qos::qos_set(&mountpoint, &settings),
        Cmd::Status {
            mountpoint,
            cluster,
            secret_file,
        } => rackfs_cli::status::status(mountpoint, cluster, secret_file),
    }
}

/// `rackfs generate man DIR` / `rackfs generate completions SHELL DIR`: prints what it wrote.
fn generate(what: GenerateCmd) -> Result<(), CliError> {
    let written = match what {
        GenerateCmd::Man { dir } => rackfs_cli::generate::man(&dir)?,
        GenerateCmd::Completions { shell, dir } => rackfs_cli::generate::completions(shell, &dir)?,
    };
    outln!("{}", written.display());
    Ok(())
}
