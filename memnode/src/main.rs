//! `rackfs-memnode`: serve a region of this host's memory to RackFS clients.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use rackfs_memnode::config::Coordination;
use rackfs_memnode::{MemNode, NodeConfig, Role};
use rackfs_proto::size::{format_size, parse_size};
use rackfs_verbs::Secret;
use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;
use tracing::info;

/// Serve a region of this host's DRAM to RackFS clients over one-sided verbs.
#[derive(Parser, Debug)]
#[command(name = "rackfs-memnode", version)]
#[command(group(clap::ArgGroup::new("elects").args(["etcd", "coordinator"])))]
struct Args {
    /// TCP address for verbs and control connections, e.g. 0.0.0.0:7070 (port 0 picks one).
    #[arg(long)]
    listen: Option<String>,
    /// Size of the memory region to serve, e.g. 512M, 64G.
    #[arg(long, value_parser = parse_size)]
    region: u64,
    /// File holding the cluster secret shared by every node and mount.
    #[arg(long)]
    secret_file: PathBuf,
    /// Unix socket for colocated (shm) clients.
    #[arg(long)]
    shm_socket: Option<PathBuf>,
    /// This node's id within the cluster.
    #[arg(long, default_value_t = 0)]
    node_id: u32,
    /// A name for logs and errors (default: mn<node-id>).
    #[arg(long)]
    name: Option<String>,
    /// This node's failure domain (a rack, a host, a power feed): the replicas of a stripe
    /// go to nodes of different domains while there are enough (default: a domain of its own).
    #[arg(long, value_name = "NAME")]
    domain: Option<String>,
    /// Microseconds a NIC thread, a control session or a control call of this node polls its
    /// connection before sleeping (0: never poll).
    #[arg(long, default_value_t = rackfs_verbs::poll::CONTROL_POLL.as_micros() as u64)]
    poll_us: u64,
    /// Run the cluster's metadata service (one node per cluster).
    #[arg(long, conflicts_with = "join")]
    primary: bool,
    /// Join the cluster whose primary is at one of these addresses (host:port or unix:PATH;
    /// comma-separated or repeated), asked in turn; with --etcd the primary is also found in
    /// etcd, and --join may be left out.
    #[arg(long, value_name = "ADDR[,ADDR...]", value_delimiter = ',', value_parser = parse_join)]
    join: Vec<String>,
    /// Milliseconds freed file data is held back before reuse (protects stale readers).
    #[arg(long, default_value_t = 2000)]
    quarantine_ms: u64,
    /// Milliseconds a mount holding range locks may go without renewing its lease (it renews
    /// every quarter of this) before it is fenced on every node and its locks recovered.
    #[arg(long, default_value_t = 4000, value_parser = clap::value_parser!(u64).range(200..=600_000))]
    lock_lease_ms: u64,
    /// Milliseconds of a data node's lease with the coordinator (it renews every quarter of
    /// this): one that lapses is declared dead, stops serving, and its stripes' other replicas
    /// carry on without it. etcd rounds leases up to whole seconds (at least 2 s).
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u64).range(200..=600_000))]
    node_lease_ms: u64,
    /// Keep the cluster map, the nodes' leases and the primary's election in etcd at these
    /// client endpoints (host:port, comma-separated); without it (or --coordinator) the
    /// primary holds them, and the cluster cannot outlive it.
    #[arg(long, value_name = "ENDPOINTS", conflicts_with = "coordinator")]
    etcd: Option<String>,
    /// Keep them in the embedded coordinator served at this address (unix:PATH or host:port)
    /// by a process of its own, as `rackfs up` does: like etcd, a standby can then take over
    /// from the primary.
    #[arg(long, value_name = "ADDR", value_parser = parse_join)]
    coordinator: Option<String>,
    /// The cluster's name: its keys live under /rackfs/NAME/ in etcd.
    #[arg(long, default_value = "rackfs", value_name = "NAME")]
    cluster: String,
    /// With --etcd or --coordinator, keep no metadata standby (primary only): changes skip the
    /// journal's round trip, and the primary's death loses the namespace.
    #[arg(long, requires = "elects")]
    no_standby: bool,
    /// Copies of every stripe of a new file, on different nodes, unless the mount asks
    /// otherwise (`-o replicas=N`); never more than the nodes at the file's creation (primary
    /// only).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=4))]
    replicas: u32,
    /// How fast stripes left with too few replicas by a dead node are copied onto other
    /// nodes, in bytes per second (e.g. 64M), so foreground I/O keeps going (primary only).
    #[arg(long, default_value = "128M", value_parser = parse_rate)]
    rebuild_rate: u64,
    /// QoS period in milliseconds: reservations and limits hold per period.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(10..=60_000))]
    qos_period_ms: u64,
    /// This node's profiled capacity in IOPS (4 KiB one-sided operations per second), the
    /// starting point of its capacity estimate; without it 1M IOPS is assumed.
    #[arg(long, value_name = "IOPS")]
    qos_capacity: Option<u64>,
    /// The most IOPS one mount can reach on this node (admission's local constraint);
    /// default: the node's capacity.
    #[arg(long, value_name = "IOPS")]
    qos_client_capacity: Option<u64>,
    /// Turn token conversion off (experiments only).
    #[arg(long)]
    qos_no_conversion: bool,
    /// Split every mount's reservation evenly over the nodes instead of by its demand
    /// (pShift off; experiments only).
    #[arg(long)]
    qos_even_split: bool,
    /// Also serve RDMA clients on this device (e.g. mlx5_0, rxe0); needs a build with the
    /// `rdma` feature.
    #[arg(long, value_name = "NAME")]
    rdma_device: Option<String>,
    /// Also serve the CPU range-lock server that `rackfs-bench locks` measures Citron against
    /// (benchmarks only: every lock operation costs this node's CPU).
    #[arg(long)]
    baseline_lock_server: bool,
    /// Serve Prometheus text metrics (memory, verbs, RPCs, QoS) over HTTP at ADDR.
    #[arg(long, value_name = "ADDR")]
    metrics_listen: Option<String>,
    /// Measure this node's QoS capacity instead of serving: clients in this process read
    /// 4 KiB one-sided over the node's transport (shm if --shm-socket is given, else tcp),
    /// 1 to 4 at once for SECONDS each; prints C_G and C_L and the flags that set them.
    #[arg(long, value_name = "SECONDS")]
    profile: Option<u64>,
}

/// One `--join` address, checked (`host:port` or `unix:PATH`).
fn parse_join(s: &str) -> Result<String, String> {
    rackfs_memnode::discover::parse_addr(s).map_err(|e| e.to_string())
}

/// A rate in bytes per second: a size such as `64M`, at least 1 MiB.
fn parse_rate(s: &str) -> Result<u64, String> {
    let v = rackfs_proto::size::parse_size(s).map_err(|e| e.to_string())?;
    if v < 1 << 20 {
        return Err(format!("{s} is below 1M per second"));
    }
    Ok(v)
}

fn main() -> ExitCode {
    // `rackfs-memnode generate-man DIR` (hidden, for scripts/install): the man page from the
    // flags' own definitions, so it never drifts from them and none is kept in git.
    let argv: Vec<String> = std::env::args().collect();
    if argv.get(1).map(String::as_str) == Some("generate-man") {
        return match argv.get(2) {
            Some(dir) => generate_man(std::path::Path::new(dir)),
            None => {
                eprintln!("rackfs-memnode: generate-man needs a directory");
                ExitCode::FAILURE
            }
        };
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        // Colours only for a terminal: logs kept in files stay plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let args = Args::parse();
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rackfs-memnode: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Writes `rackfs-memnode.1` into `dir`.
fn generate_man(dir: &std::path::Path) -> ExitCode {
    use clap::CommandFactory;
    let page = dir.join("rackfs-memnode.1");
    let written = std::fs::create_dir_all(dir).and_then(|()| {
        let mut out = Vec::new();
        clap_mangen::Man::new(Args::command()).render(&mut out)?;
        std::fs::write(&page, out)
    });
    match written {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rackfs-memnode: cannot write {}: {e}", page.display());
            ExitCode::FAILURE
        }
    }
}

/// One line on stdout; a reader that went away (`| head`) ends nothing: the node keeps
/// serving, where `println!` would panic.
fn say(line: std::fmt::Arguments) {
    use std::io::Write;
    let _ = writeln!(std::io::stdout(), "{line}");
}

fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let secret = Secret::from_file(&args.secret_file)?;
    let mut signals = Signals::new([SIGTERM, SIGINT])
        .map_err(|e| format!("cannot install signal handlers: {e}"))?;
    let profile = args.profile;
    let node = MemNode::start(NodeConfig {
        node_id: args.node_id,
        name: args.name.unwrap_or_else(|| format!("mn{}", args.node_id)),
        domain: args.domain,
        listen: args.listen,
        shm_socket: args.shm_socket.clone(),
        region_len: args.region,
        secret,
        poll: std::time::Duration::from_micros(args.poll_us),
        role: match (args.primary, args.join, profile) {
            (_, _, Some(_)) => Role::Standalone,
            (true, _, _) => Role::Primary,
            // With etcd or a served coordinator and no address, the primary is found there.
            (false, addrs, _)
                if !addrs.is_empty() || args.etcd.is_some() || args.coordinator.is_some() =>
            {
                Role::Join(addrs)
            }
            (false, _, _) => Role::Standalone,
        },
        quarantine: std::time::Duration::from_millis(args.quarantine_ms),
        lock_lease: std::time::Duration::from_millis(args.lock_lease_ms),
        node_lease: std::time::Duration::from_millis(args.node_lease_ms),
        coordinator: match (args.etcd, args.coordinator) {
            (Some(endpoints), _) => Coordination::Etcd(endpoints),
            (None, Some(addr)) => Coordination::Served(addr),
            (None, None) => Coordination::InPrimary,
        },
        cluster: args.cluster,
        replicas: args.replicas,
        rebuild_rate: args.rebuild_rate,
        qos: rackfs_memnode::qos::QosConfig {
            period: std::time::Duration::from_millis(args.qos_period_ms),
            check: std::time::Duration::from_millis(1),
            capacity_iops: args.qos_capacity,
            client_iops: args.qos_client_capacity,
            conversion: !args.qos_no_conversion,
            pshift: !args.qos_even_split,
        },
        metrics: args.metrics_listen,
        rdma_device: args.rdma_device,
        baseline_lock_server: args.baseline_lock_server,
        standby: !args.no_standby,
    })
    .map_err(|e| e.to_string())?;
    if let Some(secs) = profile {
        let secret = Secret::from_file(&args.secret_file)?;
        let connect = || match (&args.shm_socket, node.tcp_addr()) {
            (Some(p), _) => rackfs_verbs::shm::connect(p, &secret, "profile"),
            (None, Some(a)) => rackfs_verbs::tcp::connect(&a.to_string(), &secret, "profile"),
            (None, None) => unreachable!("a node listens somewhere"),
        };
        let transport = if args.shm_socket.is_some() {
            "shm"
        } else {
            "tcp"
        };
        let span = args.region.min(64 << 20) / 4096;
        let mut best = 0.0f64;
        let mut one = 0.0f64;
        for clients in 1..=4u64 {
            let qps: Vec<_> = (0..clients)
                .map(|_| connect().map_err(|e| e.to_string()))
                .collect::<Result<_, _>>()?;
            // Measuring the host's real IOPS: its own time, not a node's clock.
            let until = std::time::Instant::now() + std::time::Duration::from_secs(secs.max(1));
            let threads: Vec<_> = qps
                .into_iter()
                .enumerate()
                .map(|(i, qp)| {
                    std::thread::spawn(move || {
                        let rkey = qp.regions()[0].rkey;
                        let mut n = 0u64;
                        while std::time::Instant::now() < until {
                            let unit = (n * 7919 + i as u64 * 104_729) % span;
                            qp.read(rackfs_verbs::RemoteAddr::new(rkey, unit * 4096), 4096)
                                .expect("profile read");
                            n += 1;
                        }
                        n
                    })
                })
                .collect();
            let total: u64 = threads
                .into_iter()
                .map(|t| t.join().expect("profile thread"))
                .sum();
            let rate = total as f64 / secs.max(1) as f64;
            info!(clients, iops = rate as u64, "profile");
            if clients == 1 {
                one = rate;
            }
            best = best.max(rate);
        }
        say(format_args!(
            "profile ({transport}, 4 KiB READs): C_G = {} IOPS, C_L = {} IOPS\n\
             start the node with --qos-capacity {} --qos-client-capacity {}",
            best as u64, one as u64, best as u64, one as u64
        ));
        node.shutdown();
        return Ok(());
    }
    // One machine-readable line on stdout, for scripts and tests that start nodes on port 0.
    say(format_args!(
        "rackfs-memnode ready: node={} tcp={} shm={} region={}",
        args.node_id,
        node.tcp_addr()
            .map_or_else(|| "-".into(), |a| a.to_string()),
        args.shm_socket
            .as_ref()
            .map_or_else(|| "-".into(), |p| p.display().to_string()),
        args.region
    ));
    let signal = signals.forever().next();
    info!(?signal, "shutting down");
    node.shutdown();
    let s = node.stats();
    info!(
        verbs = s.verbs.total_ops(),
        rpcs = s.rpcs.iter().sum::<u64>(),
        used = %format_size(s.used),
        "final statistics"
    );
    Ok(())
}
