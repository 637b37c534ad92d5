//! `rackfs`: mount RackFS, run a local cluster, see what is going on.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use rackfs_fs::mount::{mount_command, state_dir};
use rackfs_fs::options::TransportChoice;
use rackfs_fs::up::{self, read_state, state_value, UpConfig};
use rackfs_memnode::control::ControlClient;
use rackfs_memnode::size::{format_size, parse_size};
use rackfs_verbs::{Opcode, Secret};

#[derive(Parser)]
#[command(
    name = "rackfs",
    version,
    about = "RackFS: a POSIX filesystem in disaggregated memory"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Start a local cluster (memory nodes on this host, shm transport) and mount it.
    Up {
        /// Mount point (created if missing).
        #[arg(default_value = up::DEFAULT_DIR)]
        dir: PathBuf,
        /// Number of memory nodes.
        #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=16))]
        nodes: u32,
        /// Region size of each memory node, e.g. 512M, 4G.
        #[arg(long, default_value = "1G", value_parser = parse_size)]
        region: u64,
        /// Transport between the mount and the nodes: shm or tcp.
        #[arg(long, default_value = "shm", value_parser = ["shm", "tcp"])]
        transport: String,
        /// Return once it is up, leaving it running in the background.
        #[arg(long)]
        detach: bool,
    },
    /// Stop what `rackfs up` started at DIR: unmount, stop the nodes, clean up.
    Down {
        #[arg(default_value = up::DEFAULT_DIR)]
        dir: PathBuf,
    },
    /// Mount a RackFS cluster: `rackfs mount HOST:PORT[,HOST:PORT...] DIR -o OPTIONS`.
    Mount {
        /// Cluster address(es): any memory node's HOST:PORT (or unix:PATH).
        source: String,
        dir: PathBuf,
        /// Mount options (see doc/CONFIGURATION.md), comma-separated.
        #[arg(short = 'o', default_value = "")]
        options: String,
        /// Stay in the foreground instead of daemonizing.
        #[arg(short = 'f', long)]
        foreground: bool,
    },
    /// Show mounts, memory nodes, capacity, usage and verb counters.
    Status {
        /// A cluster to query (default: every cluster started by `rackfs up`).
        #[arg(long)]
        cluster: Option<String>,
        /// Secret file for --cluster.
        #[arg(long, default_value = rackfs_fs::options::DEFAULT_SECRET_FILE)]
        secret_file: PathBuf,
    },
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,rackfs=info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let result = match Cli::parse().cmd {
        Cmd::Up {
            dir,
            nodes,
            region,
            transport,
            detach,
        } => {
            if detach {
                let fwd = vec![
                    "up".into(),
                    dir.display().to_string(),
                    "--nodes".into(),
                    nodes.to_string(),
                    "--region".into(),
                    region.to_string(),
                    "--transport".into(),
                    transport,
                ];
                up::up_detached(&dir, fwd)
            } else {
                up::up(UpConfig {
                    dir,
                    nodes,
                    region,
                    transport: if transport == "tcp" {
                        TransportChoice::Tcp
                    } else {
                        TransportChoice::Auto
                    },
                })
            }
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
            mount_command(&source, &dir, &options, foreground, &exe, fwd)
        }
        Cmd::Status {
            cluster,
            secret_file,
        } => status(cluster, secret_file),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rackfs: {e}");
            ExitCode::FAILURE
        }
    }
}

fn status(cluster: Option<String>, secret_file: PathBuf) -> Result<(), String> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    let ours: Vec<&str> = mounts
        .lines()
        .filter(|l| l.starts_with("rackfs:"))
        .collect();
    println!("mounts:");
    if ours.is_empty() {
        println!("  (none)");
    }
    for l in &ours {
        let f: Vec<&str> = l.split(' ').collect();
        println!("  {} on {}", f[0], f[1]);
    }
    let mut clusters: Vec<(String, PathBuf)> = Vec::new();
    if let Some(c) = cluster {
        clusters.push((c, secret_file));
    } else if let Ok(rd) = std::fs::read_dir(state_dir()) {
        for e in rd.flatten() {
            if let Some(s) = read_state(&e.path()) {
                if let (Some(p), Some(f)) =
                    (state_value(&s, "primary"), state_value(&s, "secret_file"))
                {
                    clusters.push((p, PathBuf::from(f)));
                }
            }
        }
    }
    for (addr, secret_file) in clusters {
        let secret = Secret::from_file(&secret_file)?;
        let c =
            ControlClient::connect(&addr, &secret, "rackfs-status").map_err(|e| e.to_string())?;
        let info = c.cluster().map_err(|e| e.to_string())?;
        println!("cluster {addr} (primary {}):", info.primary.name);
        println!(
            "  {:<6} {:<22} {:>11} {:>11} {:>11} {:>12} {:>12} {:>10}",
            "node", "address", "capacity", "used", "quarantine", "verbs", "bytes", "ctl rpcs"
        );
        for n in &info.nodes {
            let target = n
                .tcp
                .clone()
                .unwrap_or_else(|| format!("unix:{}", n.shm.clone().unwrap_or_default()));
            match ControlClient::connect(&target, &secret, "rackfs-status").and_then(|c| {
                c.stats().map_err(|e| rackfs_verbs::VerbsError::Protocol {
                    peer: target.clone(),
                    reason: e.to_string(),
                })
            }) {
                Ok(s) => println!(
                    "  {:<6} {:<22} {:>11} {:>11} {:>11} {:>12} {:>12} {:>10}",
                    n.name,
                    target,
                    format_size(s.capacity),
                    format_size(s.used),
                    format_size(s.quarantined),
                    s.verbs.total_ops(),
                    format_size(s.verbs.bytes.iter().sum()),
                    s.rpcs.iter().sum::<u64>()
                ),
                Err(e) => println!("  {:<6} {:<22} unreachable: {e}", n.name, target),
            }
        }
        let s = c.stats().map_err(|e| e.to_string())?;
        let by_op: Vec<String> = Opcode::ALL
            .iter()
            .map(|o| format!("{}={}", o.name(), s.verbs.ops[o.index()]))
            .collect();
        println!("  primary verbs by opcode: {}", by_op.join(" "));
        println!(
            "  range locks: {} of lock trees, {} trees recovered from dead mounts",
            format_size(s.lock_trees),
            s.lock_recoveries
        );
    }
    Ok(())
}
