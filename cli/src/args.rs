//! The command line of `rackfs`: its subcommands and flags. In the library so that the man
//! pages and the shell completions are generated from the same definitions
//! ([`crate::generate`]).

use std::path::PathBuf;

use clap::{Parser, Subcommand};
use rackfs_proto::size::parse_size;

use crate::up;

#[derive(Parser)]
#[command(
    name = "rackfs",
    version,
    about = "RackFS: a POSIX filesystem in disaggregated memory"
)]
pub struct Cli {
    #[command(subcommand)]
    pub cmd: Cmd,
}

#[derive(Subcommand)]
pub enum Cmd {
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
        /// Mount options (see doc/CONFIGURATION.md), comma-separated; `transport=` here wins
        /// over --transport, and the secret file is always the instance's own.
        #[arg(short = 'o', default_value = "")]
        options: String,
        /// Keep membership, leases and the primary's election in a local etcd started for
        /// this instance (Debian's etcd-server), instead of in the primary.
        #[arg(long)]
        etcd: bool,
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
    /// Quality of service of a mount.
    Qos {
        #[command(subcommand)]
        cmd: QosCmd,
    },
    /// Show mounts, memory nodes, capacity (raw, and usable with the default replicas), usage
    /// and verb counters.
    Status {
        /// A RackFS mount point: show its cluster, and its own QoS first.
        mountpoint: Option<PathBuf>,
        /// A cluster to query (default: every cluster started by `rackfs up`).
        #[arg(long, conflicts_with = "mountpoint")]
        cluster: Option<String>,
        /// Secret file for --cluster.
        #[arg(long, default_value = rackfs_fs::options::DEFAULT_SECRET_FILE)]
        secret_file: PathBuf,
    },
}

#[derive(Subcommand)]
pub enum QosCmd {
    /// Change a mounted RackFS's reservation, limit or weight while it runs:
    /// `rackfs qos set /mnt/rackfs reservation=5000,limit=20000`.
    Set {
        mountpoint: PathBuf,
        /// `reservation=IOPS`, `limit=IOPS`, `weight=N`, comma-separated; what is left out
        /// keeps its current value.
        settings: String,
    },
}

/// `rackfs generate ...`: for packaging (`scripts/install`), not for operators, so it is not
/// part of [`Cli`]: neither its help nor the man page and completions it writes mention it.
#[derive(Parser)]
#[command(
    name = "rackfs generate",
    about = "Write rackfs's man pages or shell completions"
)]
pub struct Generate {
    #[command(subcommand)]
    pub what: GenerateCmd,
}

impl Generate {
    /// The word after the program's name that selects this parser instead of [`Cli`].
    pub const WORD: &'static str = "generate";
}

#[derive(Subcommand)]
pub enum GenerateCmd {
    /// Man pages: rackfs.1 and one per subcommand (rackfs-up.1, ...), into DIR.
    Man { dir: PathBuf },
    /// The completion script of SHELL into DIR (rackfs.bash, _rackfs, rackfs.fish, ...).
    Completions {
        shell: clap_complete::Shell,
        dir: PathBuf,
    },
}
