//! `rackfs status`: what this host mounts and what each cluster's nodes hold and do.

use std::path::PathBuf;

use rackfs_fs::mount::{state_dir, MountRecord};
use rackfs_proto::control::{ControlRequest, ControlResponse, FsStat};
use rackfs_proto::namespace::{MetaRequest, DEFAULT_STRIPE_UNIT};
use rackfs_proto::size::format_size;
use rackfs_proto::ControlClient;
use rackfs_verbs::{Opcode, Secret};

use crate::error::CliError;
use crate::outln;
use crate::up::{pid_alive, read_state, state_value};

/// `rackfs status [MOUNTPOINT | --cluster ADDR]`: this host's RackFS mounts, then each
/// cluster's nodes, space (raw and usable), health, locks and QoS (every `rackfs up`
/// instance's when none is named).
pub fn status(
    mountpoint: Option<PathBuf>,
    cluster: Option<String>,
    secret_file: PathBuf,
) -> Result<(), CliError> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    let ours: Vec<&str> = mounts
        .lines()
        .filter(|l| l.starts_with("rackfs:"))
        .collect();
    outln!("mounts:");
    if ours.is_empty() {
        outln!("  (none)");
    }
    for l in &ours {
        let f: Vec<&str> = l.split(' ').collect();
        outln!("  {} on {}", f[0], f[1]);
    }
    let mut clusters: Vec<Target> = Vec::new();
    let mut own_slot = None;
    if let Some(m) = mountpoint {
        let dir = std::fs::canonicalize(&m).map_err(|err| CliError::Path { path: m, err })?;
        if !rackfs_fs::mount::is_rackfs_mount(&dir) {
            return Err(CliError::NotRackfs(dir));
        }
        let record = MountRecord::read(&dir).ok_or_else(|| CliError::NoRecord {
            path: dir.clone(),
            hint: "",
        })?;
        let addr = record.source.clone();
        outln!(
            "{} is {} (QoS slot {})",
            dir.display(),
            record.source,
            record
                .qos_slot
                .map_or_else(|| "none: qos=off".into(), |s| s.to_string())
        );
        own_slot = record.qos_slot;
        clusters.push(Target {
            what: format!("the cluster of {} ({addr})", dir.display()),
            addr,
            secret_file: record.secret_file,
            events: Vec::new(),
        });
    } else if let Some(c) = cluster {
        clusters.push(Target {
            what: format!("cluster {c}"),
            addr: c,
            secret_file,
            events: Vec::new(),
        });
    } else {
        clusters = up_instances()?;
        if clusters.is_empty() {
            crate::enoteln!(
                "rackfs: no cluster to show: none was started by `rackfs up` here \
                 (name one with --cluster ADDR, or a mount point)"
            );
        }
    }
    for Target {
        what,
        addr,
        secret_file,
        events,
    } in clusters
    {
        let secret = Secret::from_file(&secret_file)?;
        let unreachable = |err| CliError::Cluster {
            what: what.clone(),
            err,
        };
        let (addr, c, info) = primary_of(&addr, &secret).map_err(unreachable)?;
        outln!("cluster {addr} (primary {}):", info.primary.name);
        if !events.is_empty() {
            outln!("  what rackfs up saw (newest last):");
            for e in &events {
                outln!("    {e}");
            }
        }
        outln!("  coordinator: {}", info.coordinator);
        outln!(
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
                Some(id) => outln!(
                    "  metadata standby: {} (in sync; takes over if the primary dies)",
                    name(id)
                ),
                None => outln!(
                    "  metadata standby: NONE (the primary's death would lose the namespace)"
                ),
            }
        }
        if !info.down.is_empty() {
            outln!(
                "  DEGRADED: {} of {} memory nodes down (stripes with a replica elsewhere carry \
                 on; new data goes to the others)",
                info.down.len(),
                info.nodes.len()
            );
        }
        outln!(
            "  {:<6} {:<22} {:>11} {:>11} {:>11} {:>12} {:>12} {:>10}",
            "node",
            "address",
            "capacity",
            "used",
            "quarantine",
            "verbs",
            "bytes",
            "ctl rpcs"
        );
        for n in &info.nodes {
            let target = n
                .tcp
                .clone()
                .unwrap_or_else(|| format!("unix:{}", n.shm.clone().unwrap_or_default()));
            match ControlClient::connect(&target, &secret, "rackfs-status").and_then(|c| c.stats())
            {
                Ok(s) => {
                    outln!(
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
                        outln!("         OUT of the cluster (serves no data): {why}");
                    }
                    if let Some(d) = &n.domain {
                        outln!("         failure domain: {d}");
                    }
                    if let Some((_, e)) = info.epochs.iter().find(|e| e.0 == n.node_id) {
                        outln!("         epoch {e:x} (its lease with the coordinator)");
                    }
                    if let Some(r) = &s.rdma {
                        // One-sided verbs over RDMA never reach the node: not in the counts.
                        outln!("         rdma: {r}; {} rdma client(s) connected", s.open[3]);
                    }
                }
                Err(e) => {
                    let why = info
                        .down
                        .iter()
                        .find(|d| d.0 == n.node_id)
                        .map_or_else(|| e.to_string(), |d| d.1.clone());
                    outln!("  {:<6} {:<22} DOWN: {why}", n.name, target)
                }
            }
        }
        match c.meta(MetaRequest::StatFs) {
            Ok(ControlResponse::FsStat(fs)) => {
                for l in space_lines(&fs) {
                    outln!("{l}");
                }
            }
            Ok(other) => outln!("  space: unknown (the primary answered {other:?})"),
            Err(e) => outln!("  space: unknown ({e})"),
        }
        let s = c.stats().map_err(unreachable)?;
        let by_op: Vec<String> = Opcode::ALL
            .iter()
            .map(|o| format!("{}={}", o.name(), s.verbs.ops[o.index()]))
            .collect();
        outln!("  primary verbs by opcode: {}", by_op.join(" "));
        let h = s.health;
        let state = match (h.unavailable_files, h.degraded_files) {
            (0, 0) => "healthy",
            (0, _) => "degraded",
            _ => "UNAVAILABLE",
        };
        outln!(
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
        outln!(
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

/// The space part of `rackfs status`: the raw figures (the sum of the data nodes' memory for
/// files) and the usable ones, what files of the cluster's default replica count and the
/// default stripe unit can fill (what `df` shows on a mount that sets neither).
pub fn space_lines(fs: &FsStat) -> [String; 2] {
    let u = fs.usable(0, DEFAULT_STRIPE_UNIT);
    let nodes = match fs.nodes.len() {
        1 => "the 1 data node".to_string(),
        n => format!("the {n} data nodes"),
    };
    [
        format!(
            "  space, raw (sum of {nodes} taking data): {} capacity, {} free",
            format_size(fs.capacity),
            format_size(fs.free)
        ),
        format!(
            "  space, usable ({} replica{}, the cluster's default; {} stripes): {} capacity, {} \
             free (what df shows on a mount without replicas= or stripe_unit=)",
            u.replicas,
            if u.replicas == 1 { "" } else { "s" },
            format_size(DEFAULT_STRIPE_UNIT),
            format_size(u.capacity),
            format_size(u.free)
        ),
    ]
}

/// A cluster to show, and what to call it when it does not answer.
struct Target {
    what: String,
    /// Its nodes' addresses, comma-separated: the primary is found among them.
    addr: String,
    secret_file: PathBuf,
    /// What its `rackfs up` supervisor saw happen (nodes dying, coming back).
    events: Vec<String>,
}

/// The first of `addrs` (comma-separated) that answers as the primary: its address, its
/// connection and the cluster it describes; else the last refusal.
fn primary_of(
    addrs: &str,
    secret: &Secret,
) -> Result<(String, ControlClient, rackfs_proto::control::ClusterInfo), rackfs_proto::RpcError> {
    let ask = |addr: &str| {
        ControlClient::connect(addr, secret, "rackfs-status")
            .and_then(|c| c.cluster().map(|info| (addr.to_string(), c, info)))
    };
    let mut last = None;
    for addr in addrs.split(',').map(str::trim).filter(|a| !a.is_empty()) {
        // A data node answers with its view: the primary it names is asked next.
        let answer = ask(addr).and_then(|(a, c, info)| match info.primary.tcp.as_deref() {
            Some(p) if p != a => ask(p),
            _ => Ok((a, c, info)),
        });
        match answer {
            Ok(found) => return Ok(found),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| rackfs_proto::RpcError::Unexpected {
        peer: addrs.into(),
        what: "no address to ask".into(),
    }))
}

/// The clusters of this host's `rackfs up` instances; one whose process is gone is an error
/// that says how to clean up after it, rather than a refused connection.
fn up_instances() -> Result<Vec<Target>, CliError> {
    let Ok(rd) = std::fs::read_dir(state_dir()) else {
        return Ok(Vec::new());
    };
    let mut found = Vec::new();
    for e in rd.flatten() {
        let Some(s) = read_state(&e.path()) else {
            continue;
        };
        let (Some(addr), Some(f)) = (state_value(&s, "primary"), state_value(&s, "secret_file"))
        else {
            continue;
        };
        let mount = PathBuf::from(state_value(&s, "mount").unwrap_or_default());
        if let Some(pid) = state_value(&s, "pid").and_then(|p| p.parse().ok()) {
            if !pid_alive(pid) {
                return Err(CliError::Stale { path: mount, pid });
            }
        }
        found.push(Target {
            what: format!("the cluster of rackfs up at {} ({addr})", mount.display()),
            addr,
            secret_file: PathBuf::from(f),
            events: s
                .iter()
                .filter(|(k, _)| k == "event")
                .map(|(_, v)| v.clone())
                .collect(),
        });
    }
    Ok(found)
}

/// The QoS part of `rackfs status`: per mount R, L, weight, achieved IOPS, tokens from
/// reservation and pool, periods that missed the reservation; per node its capacity.
pub fn print_qos(q: &rackfs_proto::control::QosStatus, own: Option<u16>) {
    outln!("  QoS (IOPS = 4 KiB one-sided operations per second):");
    for n in &q.nodes {
        let per_s = |t: u64| t * 1000 / n.period_ms.max(1);
        outln!(
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
    outln!(
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
        outln!("    (* slot {s}: this mount)");
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
        outln!(
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

#[cfg(test)]
mod tests {
    use super::*;
    use rackfs_proto::space::NodeSpace;

    #[test]
    fn status_shows_raw_and_usable_space_with_the_replica_count() {
        let node = |node| NodeSpace {
            node,
            capacity: 60 << 20,
            free: 50 << 20,
        };
        let fs = FsStat {
            capacity: 120 << 20,
            free: 100 << 20,
            files: 1,
            replicas: 2,
            nodes: vec![node(0), node(1)],
        };
        let [raw, usable] = space_lines(&fs);
        assert_eq!(
            raw,
            "  space, raw (sum of the 2 data nodes taking data): 120.00 MiB capacity, 100.00 MiB free"
        );
        assert!(
            usable.starts_with(
                "  space, usable (2 replicas, the cluster's default; 1.00 MiB stripes): 59.00 MiB \
                 capacity, 49.00 MiB free"
            ),
            "{usable}"
        );
    }
}
