//! Last closes, told to the primary in batches. A release (the kernel's last close of a
//! handle) tells the primary the mount no longer has the file open, which lets an unlinked
//! file go and trims a small file's last extent. A mount queues them and sends them together
//! ([`MetaRequest::Releases`]): from a thread of their own within [`WINDOW`] of the first
//! queued, at once when [`BATCH`] wait, and always before this mount removes or renames a
//! name or asks for free space, so a file it closed and then removed is freed when the
//! removal returns. Until it is sent the primary counts the file open a little longer:
//! its memory comes back that much later, and nothing else differs. The primary answers with
//! the files' attributes after the release (a last close may trim a file's memory), which the
//! mount's leased cache keeps ([`crate::leased`]).

use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::Duration;

use rackfs_proto::control::ControlResponse;
use rackfs_proto::namespace::MetaRequest;
use tracing::warn;

use crate::cluster::Cluster;
use crate::leased::Leased;

/// How long the first queued release waits for others.
pub const WINDOW: Duration = Duration::from_millis(20);

/// How many queued releases are sent at once by the closing thread itself.
pub const BATCH: usize = 64;

/// The releases a mount has not sent yet.
pub struct Releases {
    pending: Mutex<Vec<u64>>,
    queued: Condvar,
    /// The mount's leased cache: it forgets, then learns, the released files' attributes.
    leased: Arc<Leased>,
}

impl Releases {
    /// Nothing queued; the released files' attributes go to `leased`.
    pub fn new(leased: Arc<Leased>) -> Releases {
        Releases {
            pending: Mutex::default(),
            queued: Condvar::new(),
            leased,
        }
    }

    /// Queues a release of `ino`; true when a batch is full (the caller sends it).
    pub fn add(&self, ino: u64) -> bool {
        let mut p = self.pending.lock().expect("releases lock");
        p.push(ino);
        self.queued.notify_one();
        p.len() >= BATCH
    }

    /// Sends every queued release in one request. Ones the primary did not take (it could
    /// not be reached) are queued again for the next send.
    pub fn send(&self, cl: &Cluster) {
        let inos = std::mem::take(&mut *self.pending.lock().expect("releases lock"));
        if inos.is_empty() {
            return;
        }
        let req = MetaRequest::Releases { inos: inos.clone() };
        let flight = self.leased.changing(&req);
        let sent = self.leased.news();
        let r = cl.meta(req);
        let news = self.leased.answered(flight, sent);
        match r {
            Ok(ControlResponse::Released(attrs)) => {
                if let Some(news) = news {
                    for a in &attrs {
                        self.leased.learn(None, a, news);
                    }
                }
            }
            Ok(_) => {}
            Err(e) => {
                warn!(error = %e, files = inos.len(), "the primary did not take this mount's closes; they are sent again");
                self.pending.lock().expect("releases lock").extend(inos);
            }
        }
    }

    /// Blocks until a release is queued.
    fn wait(&self) {
        let p = self.pending.lock().expect("releases lock");
        drop(
            self.queued
                .wait_while(p, |p| p.is_empty())
                .expect("releases lock"),
        );
    }
}

/// Starts the thread that sends a mount's queued releases, [`WINDOW`] after the first; it
/// ends once the cluster is dropped.
pub fn spawn(cluster: &Arc<Cluster>, releases: Arc<Releases>) {
    let weak: Weak<Cluster> = Arc::downgrade(cluster);
    let sender = move || loop {
        releases.wait();
        let Some(cl) = weak.upgrade() else { return };
        cl.clock().sleep(WINDOW);
        releases.send(&cl);
    };
    if let Err(e) = cluster
        .env()
        .spawn
        .spawn("rackfs-release", Box::new(sender))
    {
        warn!(error = %e, "no thread to send closes from: they go out in batches of {BATCH} and before removals");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_batch_is_reported_to_the_closing_thread() {
        let r = Releases::new(Arc::default());
        for ino in 1..BATCH as u64 {
            assert!(!r.add(ino));
        }
        assert!(r.add(BATCH as u64));
        assert_eq!(r.pending.lock().unwrap().len(), BATCH);
    }
}
