//! What the in-process cluster tests of the client core share.

use rackfs_proto::control::NodeAddr;

/// Node `id` of an in-process cluster, served at `n{id}` on a `Loopback`.
pub fn node(id: u32) -> NodeAddr {
    NodeAddr {
        node_id: id,
        name: format!("node{id}"),
        tcp: Some(format!("n{id}")),
        shm: None,
        capacity: 16 << 20,
        qos_area: 0,
        quarantine_ms: 1000,
        domain: None,
    }
}
