//! Last closes, told to the primary in batches. A release (the kernel's last close of a
//! handle) tells the primary the mount no longer has the file open, which lets an unlinked
//! file go and trims a small file's last extent. A mount queues them and sends them together
//! ([`MetaRequest::Releases`]): from a thread of their own within [`WINDOW`] of the first
//! queued, at once when [`BATCH`] wait, and always before this mount removes or renames a
//! name or asks for free space, so a file it closed and then removed is freed when the
//! removal returns. Until it is sent the primary counts the file open a little longer:
//! its memory comes back that much later, and nothing else differs. The primary answers with
//! the files' attributes after the release (a last close may trim a file's memory), which the
//! mount's leased cache keeps ([`crate::leased`]). A close may keep the mount's open instead
//! of giving it back ([`crate::kept`]); the kept opens given back go out with the releases.

use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::Duration;

use rackfs_proto::control::ControlResponse;
use rackfs_proto::namespace::MetaRequest;
use tracing::warn;

use crate::cluster::Cluster;
use crate::kept::{Close, Kept};
use crate::leased::Leased;

/// How long the first queued release waits for others.
pub const WINDOW: Duration = Duration::from_millis(20);

/// How many queued releases are sent at once by the closing thread itself.
pub const BATCH: usize = 64;

/// How long a kept open stays unused before it is given back ([`crate::kept`]).
pub const KEPT_IDLE: Duration = Duration::from_secs(10);

/// How often the sending thread looks for kept opens to give back (the watcher doomed them).
const SWEEP: Duration = Duration::from_millis(50);

/// How often the sending thread looks for kept opens idle for [`KEPT_IDLE`].
const EXPIRE_EVERY: Duration = Duration::from_secs(1);

/// The releases a mount has not sent yet.
pub struct Releases {
    pending: Mutex<Pending>,
    queued: Condvar,
    /// The mount's leased cache: it forgets, then learns, the released files' attributes.
    leased: Arc<Leased>,
    /// The opens this mount keeps past their last close.
    kept: Arc<Kept>,
}

/// Closes giving their open back, not sent yet (those keeping it are queued in [`Kept`]).
#[derive(Default)]
struct Pending {
    inos: Vec<u64>,
}

impl Releases {
    /// Nothing queued; the released files' attributes go to `leased`, kept opens are `kept`'s.
    pub fn new(leased: Arc<Leased>, kept: Arc<Kept>) -> Releases {
        Releases {
            pending: Mutex::default(),
            queued: Condvar::new(),
            leased,
            kept,
        }
    }

    /// Queues the last close of `ino`; true when a batch is full (the caller sends it).
    pub fn add(&self, ino: u64, close: Close) -> bool {
        let mut p = self.pending.lock().expect("releases lock");
        if close == Close::Release {
            p.inos.push(ino);
        }
        self.queued.notify_one();
        p.inos.len() + self.kept.queued() >= BATCH
    }

    /// Sends every queued release, and the kept opens to give back, in one request. Ones the
    /// primary did not take (it could not be reached) are queued again for the next send.
    pub fn send(&self, cl: &Cluster) {
        let (inos, kept) = {
            let mut p = self.pending.lock().expect("releases lock");
            p.inos.extend(self.kept.take_given_back());
            (std::mem::take(&mut p.inos), self.kept.take_queued())
        };
        self.send_now(cl, inos, kept);
    }

    /// Sends only the kept opens given back (doomed by a change the watcher heard, or
    /// idle), leaving queued closes to their batch.
    pub fn send_given_back(&self, cl: &Cluster) {
        self.send_now(cl, self.kept.take_given_back(), Vec::new());
    }

    /// Tells the primary of closes giving their opens back (`inos`) and keeping them (`kept`).
    fn send_now(&self, cl: &Cluster, inos: Vec<u64>, kept: Vec<u64>) {
        if inos.is_empty() && kept.is_empty() {
            return;
        }
        let req = MetaRequest::Releases {
            inos: inos.clone(),
            kept: kept.clone(),
        };
        let flight = self.leased.changing(&req);
        let sent = self.leased.news();
        let r = cl.meta(req);
        let news = self.leased.answered(flight, sent);
        match r {
            Ok(ControlResponse::Released(attrs)) => {
                let now = cl.clock().mono_ns();
                for &ino in &kept {
                    self.kept
                        .answered(ino, attrs.iter().find(|a| a.ino == ino), now);
                }
                if let Some(news) = news {
                    for a in &attrs {
                        self.leased.learn(None, a, news);
                    }
                }
            }
            Ok(_) => kept
                .iter()
                .for_each(|&ino| self.kept.answered(ino, None, 0)),
            Err(e) => {
                warn!(error = %e, files = inos.len() + kept.len(), "the primary did not take this mount's closes; they are sent again");
                self.pending
                    .lock()
                    .expect("releases lock")
                    .inos
                    .extend(inos);
                self.kept.requeue(&kept);
            }
        }
    }

    /// Blocks until a release is queued, or for at most [`SWEEP`].
    fn wait(&self) {
        let p = self.pending.lock().expect("releases lock");
        drop(
            self.queued
                .wait_timeout_while(p, SWEEP, |p| p.inos.is_empty() && self.kept.queued() == 0)
                .expect("releases lock"),
        );
    }

    /// Whether closes wait to be sent.
    fn any(&self) -> bool {
        let p = self.pending.lock().expect("releases lock");
        !p.inos.is_empty() || self.kept.queued() > 0
    }
}

/// Starts the thread that sends a mount's queued releases, [`WINDOW`] after the first; it
/// ends once the cluster is dropped.
pub fn spawn(cluster: &Arc<Cluster>, releases: Arc<Releases>) {
    let weak: Weak<Cluster> = Arc::downgrade(cluster);
    let clock = cluster.clock().clone();
    let mut expired = clock.mono_ns();
    let sender = move || loop {
        releases.wait();
        let now = clock.mono_ns();
        if now.saturating_sub(expired) >= EXPIRE_EVERY.as_nanos() as u64 {
            expired = now;
            let idle = now.saturating_sub(KEPT_IDLE.as_nanos() as u64);
            releases.kept.expire(idle);
        }
        let Some(cl) = weak.upgrade() else { return };
        if releases.any() {
            cl.clock().sleep(WINDOW);
            releases.send(&cl);
        } else {
            releases.send_given_back(&cl);
        }
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
        let r = Releases::new(Arc::default(), Arc::new(Kept::new(BATCH / 2)));
        for ino in 1..BATCH as u64 {
            // Half keep their opens (queued in `Kept`), the rest give them back.
            let close = r.kept.close(ino, false, true);
            assert!(!r.add(ino, close));
        }
        assert!(r.add(BATCH as u64, Close::Release));
        let p = r.pending.lock().unwrap();
        assert_eq!(p.inos.len() + r.kept.queued(), BATCH);
    }
}
