//! This node's lease, where its NIC threads do not check it: the copies its shm clients keep
//! (`rackfs_verbs::shm::LEASE_WORD` in each client's counter block, which the client checks)
//! and the sockets of its rdma clients, shut down when the lease lapses (their queue pairs go;
//! the NIC serves them without the node's CPU). Who renews the lease writes it here.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{Arc, Weak};

use rackfs_clock::Mutex;
use rackfs_verbs::lease::ServeLease;
use rackfs_verbs::shm::set_lease;
use rackfs_verbs::Region;

/// What enforces this node's lease beyond its own NIC threads: the counter blocks of its shm
/// clients (their copy of the lease) and the sockets of its rdma clients (closed when the lease
/// lapses, which destroys their queue pairs: the NIC serves them without the node's CPU).
#[derive(Default)]
pub struct LeaseWords {
    blocks: Mutex<Vec<Weak<Region>>>,
    rdma: Mutex<Vec<Weak<OwnedFd>>>,
}

impl LeaseWords {
    /// A new shm client's counter block: it gets the lease's deadline now and on every
    /// renewal, as long as it lives.
    pub fn add(&self, block: &Arc<Region>, lease: &ServeLease) {
        self.blocks
            .lock()
            .expect("lease words lock")
            .push(Arc::downgrade(block));
        set_lease(block, lease.until(), true);
    }

    /// An rdma client's socket (a duplicate), shut down if the lease lapses.
    pub fn add_rdma(&self, socket: &Arc<OwnedFd>) {
        self.rdma
            .lock()
            .expect("lease words lock")
            .push(Arc::downgrade(socket));
    }

    /// The lease lapsed: every rdma client's connection is shut down (they reconnect once it
    /// is renewed; the handshake refuses data connections meanwhile).
    pub fn lapsed(&self) {
        let mut v = self.rdma.lock().expect("lease words lock");
        for s in v.iter().filter_map(Weak::upgrade) {
            // SAFETY: shutdown(2) on a socket descriptor the connection's thread owns and keeps
            // open while this Arc lives; it only ends the connection.
            unsafe { libc::shutdown(s.as_raw_fd(), libc::SHUT_RDWR) };
        }
        v.clear();
    }

    /// Copies the lease's deadline into every live client's block.
    pub fn publish(&self, until: u64) {
        let mut v = self.blocks.lock().expect("lease words lock");
        v.retain(|w| match w.upgrade() {
            Some(b) => {
                set_lease(&b, until, false);
                true
            }
            None => false,
        });
    }
}
