//! `rackfs`: mount RackFS, run a local cluster, see what is going on.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use rackfs_fs::mount::{mount_command, state_dir, MountRecord};
use rackfs_fs::options::{MountOptions, TransportChoice};
use rackfs_fs::up::{self, read_state, state_value, UpConfig};
use rackfs_proto::control::{ControlRequest, ControlResponse};
use rackfs_proto::size::{format_size, parse_size};
use rackfs_proto::ControlClient;
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
    /// Show mounts, memory nodes, capacity, usage and verb counters.
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
enum QosCmd {
    /// Change a mounted RackFS's reservation, limit or weight while it runs:
    /// `rackfs qos set /mnt/rackfs reservation=5000,limit=20000`.
    Set {
        mountpoint: PathBuf,
        /// `reservation=IOPS`, `limit=IOPS`, `weight=N`, comma-separated; what is left out
        /// keeps its current value.
        settings: String,
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
    let result: Result<(), Box<dyn std::error::Error>> = match Cli::parse().cmd {
        Cmd::Up {
            dir,
            nodes,
            region,
            transport,
            detach,
            options,
            etcd,
        } => match up_options(&transport, &options) {
            // Bad options fail here, before anything starts.
            Err(e) => Err(e),
            Ok(_) if detach => {
                let fwd = vec![
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
                let fwd = [fwd, etcd.then(|| "--etcd".into()).into_iter().collect()].concat();
                up::up_detached(&dir, fwd).map_err(Into::into)
            }
            Ok(mount) => up::up(UpConfig {
                dir,
                nodes,
                region,
                mount,
                etcd,
            })
            .map_err(Into::into),
        },
        Cmd::Down { dir } => up::down(&dir).map_err(Into::into),
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
            mount_command(&source, &dir, &options, foreground, &exe, fwd).map_err(Into::into)
        }
        Cmd::Qos {
            cmd: QosCmd::Set {
                mountpoint,
                settings,
            },
        } => qos_set(&mountpoint, &settings),
        Cmd::Status {
            mountpoint,
            cluster,
            secret_file,
        } => status(mountpoint, cluster, secret_file),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rackfs: {e}");
            ExitCode::FAILURE
        }
    }
}

fn status(
    mountpoint: Option<PathBuf>,
    cluster: Option<String>,
    secret_file: PathBuf,
) -> Result<(), Box<dyn std::error::Error>> {
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
    let mut own_slot = None;
    if let Some(m) = mountpoint {
        let dir = std::fs::canonicalize(&m).map_err(|e| format!("{}: {e}", m.display()))?;
        if !rackfs_fs::mount::is_rackfs_mount(&dir) {
            return Err(format!("{} is not a RackFS mount", dir.display()).into());
        }
        let record =
            MountRecord::read(&dir).ok_or(format!("{}: no record of this mount", dir.display()))?;
        let addr = record.source.split(',').next().unwrap_or("").to_string();
        println!(
            "{} is {} (QoS slot {})",
            dir.display(),
            record.source,
            record
                .qos_slot
                .map_or_else(|| "none: qos=off".into(), |s| s.to_string())
        );
        own_slot = record.qos_slot;
        clusters.push((addr, record.secret_file));
    } else if let Some(c) = cluster {
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
        println!("  coordinator: {}", info.coordinator);
        println!(
            "  mounts holding a lock lease: {} {:?}",
            info.mounts.len(),
            info.mounts
        );
        if info.elects {
            let name = |id: u32| {
                info.nodes
                    .iter()
                    .find(|n| n.node_id == id)
                    .map_or_else(|| format!("node {id}"), |n| n.name.clone())
            };
            match info.standby {
                Some(id) => println!(
                    "  metadata standby: {} (in sync; takes over if the primary dies)",
                    name(id)
                ),
                None => println!(
                    "  metadata standby: NONE (the primary's death would lose the namespace)"
                ),
            }
        }
        if !info.down.is_empty() {
            println!(
                "  DEGRADED: {} of {} memory nodes down (stripes with a replica elsewhere carry \
                 on; new data goes to the others)",
                info.down.len(),
                info.nodes.len()
            );
        }
        println!(
            "  {:<6} {:<22} {:>11} {:>11} {:>11} {:>12} {:>12} {:>10}",
            "node", "address", "capacity", "used", "quarantine", "verbs", "bytes", "ctl rpcs"
        );
        for n in &info.nodes {
            let target = n
                .tcp
                .clone()
                .unwrap_or_else(|| format!("unix:{}", n.shm.clone().unwrap_or_default()));
            match ControlClient::connect(&target, &secret, "rackfs-status").and_then(|c| c.stats())
            {
                Ok(s) => {
                    println!(
                        "  {:<6} {:<22} {:>11} {:>11} {:>11} {:>12} {:>12} {:>10}",
                        n.name,
                        target,
                        format_size(s.capacity),
                        format_size(s.used),
                        format_size(s.quarantined),
                        s.verbs.total_ops(),
                        format_size(s.verbs.bytes.iter().sum()),
                        s.rpcs.iter().sum::<u64>()
                    );
                    if let Some((_, why)) = info.down.iter().find(|d| d.0 == n.node_id) {
                        // It answers here, but the primary holds it out (its lease lapsed).
                        println!("         OUT of the cluster (serves no data): {why}");
                    }
                    if let Some(d) = &n.domain {
                        println!("         failure domain: {d}");
                    }
                    if let Some((_, e)) = info.epochs.iter().find(|e| e.0 == n.node_id) {
                        println!("         epoch {e:x} (its lease with the coordinator)");
                    }
                    if let Some(r) = &s.rdma {
                        // One-sided verbs over RDMA never reach the node: not in the counts.
                        println!("         rdma: {r}; {} rdma client(s) connected", s.open[3]);
                    }
                }
                Err(e) => {
                    let why = info
                        .down
                        .iter()
                        .find(|d| d.0 == n.node_id)
                        .map_or_else(|| e.to_string(), |d| d.1.clone());
                    println!("  {:<6} {:<22} DOWN: {why}", n.name, target)
                }
            }
        }
        let s = c.stats().map_err(|e| e.to_string())?;
        let by_op: Vec<String> = Opcode::ALL
            .iter()
            .map(|o| format!("{}={}", o.name(), s.verbs.ops[o.index()]))
            .collect();
        println!("  primary verbs by opcode: {}", by_op.join(" "));
        let h = s.health;
        let state = match (h.unavailable_files, h.degraded_files) {
            (0, 0) => "healthy",
            (0, _) => "degraded",
            _ => "UNAVAILABLE",
        };
        println!(
            "  data: {state}: {} files, {} degraded ({} stripes below their replicas), {} \
             unavailable (every replica of a stripe on a down node: EIO); re-replicated {} \
             stripes, {}",
            h.files,
            h.degraded_files,
            h.degraded_stripes,
            h.unavailable_files,
            h.rebuilt_stripes,
            format_size(h.rebuilt_bytes)
        );
        println!(
            "  range locks: {} of lock trees, {} trees recovered from dead mounts",
            format_size(s.lock_trees),
            s.lock_recoveries
        );
        if let Ok(ControlResponse::QosStatus(q)) = c.call(&ControlRequest::QosStatus) {
            print_qos(&q, own_slot);
        }
    }
    Ok(())
}

/// The mount options of `rackfs up`: `-o`, with `--transport` unless `-o` names one.
fn up_options(transport: &str, options: &str) -> Result<MountOptions, Box<dyn std::error::Error>> {
    let mut o = MountOptions::parse(options)?;
    let named = options
        .split(',')
        .any(|i| i.trim().starts_with("transport="));
    if !named {
        o.transport = if transport == "tcp" {
            TransportChoice::Tcp
        } else {
            TransportChoice::Auto
        };
    }
    Ok(o)
}

/// The QoS part of `rackfs status`: per mount R, L, weight, achieved IOPS, tokens from
/// reservation and pool, periods that missed the reservation; per node its capacity.
fn print_qos(q: &rackfs_proto::control::QosStatus, own: Option<u16>) {
    println!("  QoS (IOPS = 4 KiB one-sided operations per second):");
    for n in &q.nodes {
        let per_s = |t: u64| t * 1000 / n.period_ms.max(1);
        println!(
            "    node {}: capacity estimate {} IOPS ({}), period {} ms",
            n.node_id,
            per_s(n.capacity),
            if n.profiled {
                "profiled"
            } else {
                "not profiled, assumed"
            },
            n.period_ms
        );
    }
    println!(
        "    {:<5} {:>11} {:>11} {:>6} {:>30} {:>12} {:>12} {:>7}",
        "slot",
        "reservation",
        "limit",
        "weight",
        "IOPS, last periods",
        "from res.",
        "from pool",
        "missed"
    );
    if let Some(s) = own {
        println!("    (* slot {s}: this mount)");
    }
    for m in &q.mounts {
        // Per period (over the nodes' common recent periods): tokens spent and from the pool.
        let mut per_period: std::collections::BTreeMap<u64, (u64, u64, u64, u64)> =
            Default::default();
        let mut period_ms = 1000;
        for n in &q.nodes {
            period_ms = n.period_ms.max(1);
            // Periods before this mount took the slot were another mount's.
            let since = m.since.iter().find(|s| s.0 == n.node_id).map_or(0, |s| s.1);
            for p in n.periods.iter().filter(|p| p.period > since) {
                if let Some(&(_, r, used, pool, asked)) = p.mounts.iter().find(|e| e.0 == m.slot) {
                    let e = per_period.entry(p.period).or_default();
                    e.0 += used;
                    e.1 += pool;
                    e.2 += r;
                    e.3 += asked;
                }
            }
        }
        let last: Vec<String> = per_period
            .values()
            .rev()
            .take(4)
            .map(|e| (e.0 * 1000 / period_ms).to_string())
            .collect();
        let (res, pool): (u64, u64) = per_period
            .values()
            .fold((0, 0), |a, e| (a.0 + e.0 - e.1, a.1 + e.1));
        let missed = per_period
            .values()
            .filter(|e| e.0 < e.2 && e.3 >= e.2)
            .count();
        let lim = if m.limit == 0 {
            "-".to_string()
        } else {
            m.limit.to_string()
        };
        let slot = if own == Some(m.slot) {
            format!("{}*", m.slot)
        } else {
            m.slot.to_string()
        };
        println!(
            "    {:<5} {:>11} {:>11} {:>6} {:>30} {:>12} {:>12} {:>7}",
            slot,
            m.reservation,
            lim,
            m.weight,
            last.join(" "),
            res,
            pool,
            missed
        );
    }
}

/// `rackfs qos set`: the mount's slot comes from its state file, the cluster from its source.
fn qos_set(mountpoint: &std::path::Path, settings: &str) -> Result<(), Box<dyn std::error::Error>> {
    let dir =
        std::fs::canonicalize(mountpoint).map_err(|e| format!("{}: {e}", mountpoint.display()))?;
    let (_, source) = rackfs_fs::mount::mount_type(&dir)
        .filter(|(fstype, _)| rackfs_fs::mount::is_rackfs_mount(&dir) || fstype.contains("rackfs"))
        .ok_or(format!("{} is not a RackFS mount", dir.display()))?;
    let record = MountRecord::read(&dir).ok_or(format!(
        "{}: no record of this mount (was it mounted by another host's rackfs?)",
        dir.display()
    ))?;
    let slot = record
        .qos_slot
        .ok_or(format!("{} was mounted with qos=off", dir.display()))?;
    let secret = Secret::from_file(&record.secret_file)?;
    let addr = source
        .trim_start_matches("rackfs:")
        .split(',')
        .next()
        .unwrap_or("")
        .to_string();
    let c = ControlClient::connect(&addr, &secret, "rackfs-qos").map_err(|e| e.to_string())?;
    let current = match c.call(&ControlRequest::QosStatus) {
        Ok(ControlResponse::QosStatus(q)) => q.mounts.into_iter().find(|m| m.slot == slot),
        other => return Err(format!("QoS status: {other:?}").into()),
    }
    .ok_or(format!(
        "the cluster has no QoS for slot {slot} (is the mount still alive?)"
    ))?;
    let (mut reservation, mut limit, mut weight) =
        (current.reservation, current.limit, current.weight);
    for item in settings.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let (k, v) = item
            .split_once('=')
            .ok_or(format!("{item:?}: expected key=value"))?;
        let iops = || rackfs_fs::options::parse_iops(v).ok_or(format!("{k}={v}: expected IOPS"));
        match k {
            "reservation" => reservation = iops()?,
            "limit" => limit = iops()?,
            "weight" => {
                weight = v
                    .parse()
                    .ok()
                    .filter(|w| (1..=10_000).contains(w))
                    .ok_or(format!("weight={v}: expected a number from 1 to 10000"))?
            }
            _ => {
                return Err(
                    format!("unknown QoS setting {k:?} (reservation, limit, weight)").into(),
                )
            }
        }
    }
    match c.call(&ControlRequest::QosSet {
        slot: Some(slot),
        reservation,
        limit,
        weight,
    }) {
        Ok(ControlResponse::QosGranted { .. }) => {
            println!(
                "{}: reservation {reservation} IOPS, limit {}, weight {weight}",
                dir.display(),
                if limit == 0 {
                    "none".to_string()
                } else {
                    format!("{limit} IOPS")
                }
            );
            Ok(())
        }
        Ok(other) => Err(format!("unexpected reply {other:?}").into()),
        Err(e) => Err(e.into()),
    }
}
