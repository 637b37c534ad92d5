//! A mount's own metrics (`-o metrics=ADDR`, Prometheus text): per filesystem operation the
//! count, the errors by errno and the latency; control RPCs' latency by kind; how long verbs
//! batches, range locks and QoS admission took; QoS tokens spent against the reservation.
//!
//! The core records into one [`MountMetrics`] per mount (the adapter records each filesystem
//! operation as a whole: [`MountMetrics::op`]); control RPCs are timed by wrapping the mount's
//! dialer ([`Metered`]), so every connection the core opens is counted, whoever opens it.
//! Everything is a relaxed atomic or taken on the error path only, so recording costs a few
//! nanoseconds next to a FUSE round trip of microseconds.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rackfs_metrics::{Histogram, Page};
use rackfs_proto::control::{ControlRequest, ControlResponse, RPC_KINDS};
use rackfs_proto::RpcError;
use rackfs_verbs::Secret;

use crate::clock::SharedClock;
use crate::link::{ControlLink, Dial};

/// The filesystem operations a mount serves, by the name metrics give them.
pub const OPS: [&str; 30] = [
    "lookup",
    "getattr",
    "setattr",
    "fallocate",
    "setxattr",
    "getxattr",
    "listxattr",
    "removexattr",
    "readlink",
    "mknod",
    "mkdir",
    "unlink",
    "rmdir",
    "symlink",
    "rename",
    "link",
    "open",
    "create",
    "read",
    "write",
    "flush",
    "getlk",
    "setlk",
    "fsync",
    "release",
    "opendir",
    "readdir",
    "readdirplus",
    "statfs",
    "access",
];

/// One mount's counters and histograms (see the module docs).
pub struct MountMetrics {
    ops: Vec<Histogram>,
    /// Errors by (operation, errno); taken only when an operation fails.
    errors: Mutex<BTreeMap<(usize, i32), u64>>,
    rpcs: Vec<Histogram>,
    rpc_errors: Vec<AtomicU64>,
    /// One verbs batch, posted to done (per node).
    pub batches: Histogram,
    /// Waiting for a range lock.
    pub lock_wait: Histogram,
    /// Waiting for QoS admission.
    pub qos_wait: Histogram,
}

impl Default for MountMetrics {
    fn default() -> Self {
        MountMetrics {
            ops: OPS.iter().map(|_| Histogram::default()).collect(),
            errors: Mutex::default(),
            rpcs: RPC_KINDS.iter().map(|_| Histogram::default()).collect(),
            rpc_errors: RPC_KINDS.iter().map(|_| AtomicU64::default()).collect(),
            batches: Histogram::default(),
            lock_wait: Histogram::default(),
            qos_wait: Histogram::default(),
        }
    }
}

/// The symbolic name of an errno the filesystem returns (its number otherwise).
pub fn errno_name(e: i32) -> String {
    let name = match e {
        libc::EPERM => "EPERM",
        libc::ENOENT => "ENOENT",
        libc::EINTR => "EINTR",
        libc::EIO => "EIO",
        libc::E2BIG => "E2BIG",
        libc::EBADF => "EBADF",
        libc::EAGAIN => "EAGAIN",
        libc::EACCES => "EACCES",
        libc::EEXIST => "EEXIST",
        libc::EXDEV => "EXDEV",
        libc::ENOTDIR => "ENOTDIR",
        libc::EISDIR => "EISDIR",
        libc::EINVAL => "EINVAL",
        libc::EFBIG => "EFBIG",
        libc::ENOSPC => "ENOSPC",
        libc::EROFS => "EROFS",
        libc::EMLINK => "EMLINK",
        libc::ERANGE => "ERANGE",
        libc::ENAMETOOLONG => "ENAMETOOLONG",
        libc::ENOSYS => "ENOSYS",
        libc::ENOTEMPTY => "ENOTEMPTY",
        libc::ENODATA => "ENODATA",
        libc::EPROTO => "EPROTO",
        libc::EOPNOTSUPP => "EOPNOTSUPP",
        libc::ESTALE => "ESTALE",
        libc::EDQUOT => "EDQUOT",
        _ => return e.to_string(),
    };
    name.into()
}

impl MountMetrics {
    /// Records one filesystem operation `op` (a name of [`OPS`]) that took `took` and ended
    /// with `errno` (`None`: it succeeded).
    pub fn op(&self, op: &str, took: Duration, errno: Option<i32>) {
        let Some(i) = OPS.iter().position(|&o| o == op) else {
            debug_assert!(false, "operation {op} is not in OPS");
            return;
        };
        self.ops[i].observe(took);
        if let Some(e) = errno {
            *self
                .errors
                .lock()
                .expect("metrics errors lock")
                .entry((i, e))
                .or_default() += 1;
        }
    }

    /// Records one control RPC of `kind` (an index of [`RPC_KINDS`]).
    fn rpc(&self, kind: usize, took: Duration, failed: bool) {
        if let Some(h) = self.rpcs.get(kind) {
            h.observe(took);
        }
        if failed {
            if let Some(c) = self.rpc_errors.get(kind) {
                c.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// How many times `op` ran (tests and `rackfs status`).
    pub fn op_count(&self, op: &str) -> u64 {
        OPS.iter()
            .position(|&o| o == op)
            .map_or(0, |i| self.ops[i].count())
    }

    /// Writes this mount's families into `p`, labelled `mount`.
    pub fn render(&self, p: &mut Page, mount: &str) {
        for (i, h) in self.ops.iter().enumerate().filter(|(_, h)| h.count() > 0) {
            p.histogram(
                "mount_op_seconds",
                "Filesystem operations served by the mount, by operation: latency.",
                &[("mount", mount), ("op", OPS[i])],
                h,
            );
        }
        let errors = self.errors.lock().expect("metrics errors lock").clone();
        for ((i, e), n) in errors {
            p.counter(
                "mount_op_errors_total",
                "Filesystem operations that failed, by operation and errno.",
                &[("mount", mount), ("op", OPS[i]), ("errno", &errno_name(e))],
                n,
            );
        }
        for (i, h) in self.rpcs.iter().enumerate().filter(|(_, h)| h.count() > 0) {
            p.histogram(
                "mount_rpc_seconds",
                "Control RPCs the mount made, by kind: latency.",
                &[("mount", mount), ("kind", RPC_KINDS[i])],
                h,
            );
        }
        for (i, c) in self.rpc_errors.iter().enumerate() {
            let n = c.load(Ordering::Relaxed);
            if n > 0 {
                p.counter(
                    "mount_rpc_errors_total",
                    "Control RPCs that failed or were refused, by kind.",
                    &[("mount", mount), ("kind", RPC_KINDS[i])],
                    n,
                );
            }
        }
        for (name, help, h) in [
            (
                "mount_verbs_batch_seconds",
                "One-sided verbs batches, posted to completed, per node.",
                &self.batches,
            ),
            (
                "mount_lock_wait_seconds",
                "Waiting for a range lock (writes and truncates).",
                &self.lock_wait,
            ),
            (
                "mount_qos_wait_seconds",
                "Waiting for QoS admission of data operations.",
                &self.qos_wait,
            ),
        ] {
            p.histogram(name, help, &[("mount", mount)], h);
        }
    }
}

/// A dialer whose connections time every call into a mount's [`MountMetrics`].
pub struct Metered {
    inner: Arc<dyn Dial>,
    metrics: Arc<MountMetrics>,
    clock: SharedClock,
}

impl Metered {
    pub fn new(inner: Arc<dyn Dial>, metrics: Arc<MountMetrics>, clock: SharedClock) -> Metered {
        Metered {
            inner,
            metrics,
            clock,
        }
    }
}

impl Dial for Metered {
    fn connect(
        &self,
        addr: &str,
        secret: &Secret,
        client_name: &str,
    ) -> Result<Arc<dyn ControlLink>, RpcError> {
        let link = self.inner.connect(addr, secret, client_name)?;
        Ok(Arc::new(MeteredLink {
            link,
            metrics: self.metrics.clone(),
            clock: self.clock.clone(),
        }))
    }
}

struct MeteredLink {
    link: Arc<dyn ControlLink>,
    metrics: Arc<MountMetrics>,
    clock: SharedClock,
}

impl ControlLink for MeteredLink {
    fn call(&self, req: &ControlRequest) -> Result<ControlResponse, RpcError> {
        let started = self.clock.now();
        let r = self.link.call(req);
        let took = self.clock.now().saturating_sub(started);
        self.metrics.rpc(req.kind_index(), took, r.is_err());
        r
    }
    fn set_deadline(&self, d: Duration) {
        self.link.set_deadline(d)
    }
    fn peer(&self) -> &str {
        self.link.peer()
    }
    fn node_id(&self) -> u32 {
        self.link.node_id()
    }
    fn node_name(&self) -> &str {
        self.link.node_name()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn operations_and_errors_are_rendered_by_name() {
        let m = MountMetrics::default();
        m.op("lookup", Duration::from_micros(30), None);
        m.op("lookup", Duration::from_micros(40), Some(libc::ENOENT));
        m.op("write", Duration::from_micros(3), Some(libc::ENOSPC));
        assert_eq!(m.op_count("lookup"), 2);
        let mut p = Page::new();
        m.render(&mut p, "/mnt");
        let text = p.finish();
        assert!(
            text.contains("rackfs_mount_op_seconds_count{mount=\"/mnt\",op=\"lookup\"} 2\n"),
            "{text}"
        );
        assert!(
            text.contains(
                "rackfs_mount_op_errors_total{mount=\"/mnt\",op=\"lookup\",errno=\"ENOENT\"} 1\n"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "rackfs_mount_op_errors_total{mount=\"/mnt\",op=\"write\",errno=\"ENOSPC\"} 1\n"
            ),
            "{text}"
        );
        assert!(
            !text.contains("op=\"mkdir\""),
            "unused operations are left out: {text}"
        );
        assert!(text.contains("rackfs_mount_lock_wait_seconds_count{mount=\"/mnt\"} 0\n"));
    }

    #[test]
    fn every_rpc_kind_has_a_histogram_and_errno_names_fall_back_to_numbers() {
        let m = MountMetrics::default();
        m.rpc(RPC_KINDS.len() - 1, Duration::from_millis(1), true);
        m.rpc(RPC_KINDS.len(), Duration::from_millis(1), true); // out of range: ignored
        let mut p = Page::new();
        m.render(&mut p, "m");
        let text = p.finish();
        let last = RPC_KINDS[RPC_KINDS.len() - 1];
        assert!(
            text.contains(&format!(
                "rackfs_mount_rpc_errors_total{{mount=\"m\",kind=\"{last}\"}} 1\n"
            )),
            "{text}"
        );
        assert_eq!(errno_name(libc::ENOENT), "ENOENT");
        assert_eq!(errno_name(9999), "9999");
    }
}
