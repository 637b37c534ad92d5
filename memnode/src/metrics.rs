//! A Prometheus text endpoint (`--metrics-listen ADDR`): the node's memory, verbs and RPC
//! counters, and its QoS state (capacity estimate and, per mount slot, the last period's
//! reservation, tokens spent and tokens from the pool). Plain HTTP/1.0, one response per
//! connection, any path.

use std::fmt::Write as _;

use rackfs_verbs::Opcode;

use rackfs_proto::control::{NodeStats, QosNodeStatus, RPC_KINDS};

/// The exposition text for one node.
pub fn render(s: &NodeStats, qos: Option<&QosNodeStatus>) -> String {
    let mut o = String::new();
    let node = &s.name;
    let mut gauge = |name: &str, help: &str, v: u64| {
        let _ = writeln!(o, "# HELP rackfs_{name} {help}\n# TYPE rackfs_{name} gauge");
        let _ = writeln!(o, "rackfs_{name}{{node=\"{node}\"}} {v}");
    };
    gauge("region_bytes", "Bytes of the node's region.", s.capacity);
    gauge(
        "used_bytes",
        "Bytes allocated, quarantine included.",
        s.used,
    );
    gauge(
        "quarantined_bytes",
        "Bytes freed but held back from reuse.",
        s.quarantined,
    );
    gauge(
        "lock_tree_bytes",
        "Bytes of range-lock trees.",
        s.lock_trees,
    );
    gauge(
        "lock_recoveries",
        "Lock trees replaced after a mount died in them.",
        s.lock_recoveries,
    );
    let h = &s.health;
    gauge("files", "Regular files (primary).", h.files);
    gauge(
        "files_degraded",
        "Files with a stripe below its replication factor (primary).",
        h.degraded_files,
    );
    gauge(
        "files_unavailable",
        "Files with a stripe none of whose replicas is on a live node (primary).",
        h.unavailable_files,
    );
    gauge(
        "stripes_degraded",
        "Stripes below their replication factor, waiting to be copied (primary).",
        h.degraded_stripes,
    );
    gauge(
        "rebuilt_stripes",
        "Stripes copied back to their replication factor (primary).",
        h.rebuilt_stripes,
    );
    gauge(
        "rebuilt_bytes",
        "Bytes copied by re-replication (primary).",
        h.rebuilt_bytes,
    );
    gauge(
        "auth_failures",
        "Connections refused for a wrong secret.",
        s.auth_failures,
    );
    gauge(
        "protocol_errors",
        "Connections closed for malformed frames.",
        s.protocol_errors,
    );
    gauge(
        "journal_entries",
        "Journal entries replayed on this node's mirror of the namespace (metadata standby; with the journal RPCs, how many changes share a round trip).",
        s.journal_entries,
    );
    let _ = writeln!(
        o,
        "# HELP rackfs_verbs_total Verbs executed, by opcode.\n# TYPE rackfs_verbs_total counter"
    );
    for op in Opcode::ALL {
        let _ = writeln!(
            o,
            "rackfs_verbs_total{{node=\"{node}\",op=\"{}\"}} {}",
            op.name().to_lowercase(),
            s.verbs.ops[op.index()]
        );
    }
    let _ = writeln!(
        o,
        "# HELP rackfs_rpcs_total Control RPCs served, by kind.\n# TYPE rackfs_rpcs_total counter"
    );
    for (i, k) in RPC_KINDS.iter().enumerate() {
        let _ = writeln!(
            o,
            "rackfs_rpcs_total{{node=\"{node}\",kind=\"{k}\"}} {}",
            s.rpcs[i]
        );
    }
    if let Some(q) = qos {
        let per_s = |t: u64| t * 1000 / q.period_ms.max(1);
        let _ = writeln!(
            o,
            "# HELP rackfs_qos_capacity_iops The node's capacity estimate.\n# TYPE rackfs_qos_capacity_iops gauge\nrackfs_qos_capacity_iops{{node=\"{node}\",profiled=\"{}\"}} {}",
            q.profiled,
            per_s(q.capacity)
        );
        if let Some(p) = q.periods.last() {
            let _ = writeln!(o, "# HELP rackfs_qos_mount_iops A mount's last period on this node: reservation share, IOPS spent, IOPS from the pool.\n# TYPE rackfs_qos_mount_iops gauge");
            for &(slot, r, used, pool, _) in &p.mounts {
                for (what, v) in [("reservation", r), ("spent", used), ("from_pool", pool)] {
                    let _ = writeln!(
                        o,
                        "rackfs_qos_mount_iops{{node=\"{node}\",slot=\"{slot}\",what=\"{what}\"}} {}",
                        per_s(v)
                    );
                }
            }
        }
    }
    o
}

/// Serves `page()` on `listener` until the process ends.
pub use rackfs_metrics::serve;
