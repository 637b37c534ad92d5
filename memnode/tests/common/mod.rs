//! What the tests that run memory nodes in this process share: a scratch directory, the
//! cluster's secret, a node's configuration and addresses.

use std::path::{Path, PathBuf};
use std::time::Duration;

use rackfs_memnode::config::Coordination;
use rackfs_memnode::qos::QosConfig;
use rackfs_memnode::{NodeConfig, Role};
use rackfs_verbs::Secret;

pub fn secret() -> Secret {
    Secret::new(b"in-process-memnode-test-secret").expect("a secret")
}

/// Node `id`'s Unix socket in `dir` (bound; in-process peers reach it on a loopback).
pub fn socket(dir: &Path, id: u32) -> PathBuf {
    dir.join(format!("mn{id}.sock"))
}

/// Where node `id` is reached: `unix:` and its socket (a joining node's address).
pub fn addr(dir: &Path, id: u32) -> String {
    format!("unix:{}", socket(dir, id).display())
}

/// Node `id` of a test's cluster in `role`, its socket in `dir`: no tcp listener, the
/// coordinator embedded in the primary, no standby, a 32 MiB region.
pub fn config(dir: &Path, id: u32, role: Role) -> NodeConfig {
    NodeConfig {
        node_id: id,
        name: format!("mn{id}"),
        domain: None,
        listen: None,
        shm_socket: Some(socket(dir, id)),
        region_len: 32 << 20,
        secret: secret(),
        poll: Duration::ZERO,
        role,
        quarantine: Duration::from_secs(1),
        lock_lease: Duration::from_secs(5),
        node_lease: Duration::from_secs(3),
        coordinator: Coordination::InPrimary,
        cluster: "in-process".into(),
        standby: false,
        replicas: 2,
        rebuild_rate: 1 << 20,
        qos: QosConfig::default(),
        metrics: None,
        rdma_device: None,
        baseline_lock_server: false,
    }
}

/// A scratch directory of the test's own (`name`), removed when dropped.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(name: &str) -> Scratch {
        let d =
            std::env::temp_dir().join(format!("rackfs-in-process-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&d).expect("a scratch directory");
        Scratch(d)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
