//! The threads of the client core, started through a [`Spawn`] handed in with the core's
//! [`crate::env::Env`], so a test or a simulation decides when (and whether) their work runs.
//! On a live mount they are OS threads ([`Threads`]).
//!
//! The core starts these, each named so:
//!
//! | thread | started by | runs until |
//! |---|---|---|
//! | `lease` | `Cluster::lock_client`, the first range or record lock of a session | the cluster is dropped, or the primary fenced the session |
//! | `qos-ticker` | `Cluster::start_qos_ticker`, by `mount::prepare` when `qos=on` | the cluster is dropped |
//! | `rackfs-watch` | `watch::spawn`, by the mount once its FUSE session exists (`attr_timeout` > 0) | the process ends |
//! | `rackfs-release` | `releases::spawn`, by the mount once its FUSE session exists | the cluster is dropped (at the next queued release) |
//! | `rackfs-lockwait` | `Client::setlk`, one per `F_SETLKW`/`flock` that must wait | the lock is granted or the wait interrupted |
//! | `rackfs-keep` | `FileLocks::lock`, when a write is lent its range from a lock tree the mount keeps | the mount gives the tree back (another mount waits, the tree is replaced, or 20 ms without a write) |
//! | `rackfs-reclaim` | the failover hook `Client::new` registers, once per failover | the mount's record locks are reclaimed from the new primary |
//! | `rackfs-members` | `Cluster::keep_members_known`, by `Client::new` | the cluster is dropped |
//!
//! Outside the core, the mount starts fuser's workers and a thread waiting for SIGTERM
//! (`crate::mount`), which stay OS threads.

use std::collections::VecDeque;
use std::sync::Mutex;

pub use rackfs_clock::spawn::{Spawn, Threads, Work};

/// Work kept until its caller runs it ([`Queue::run_next`]): a test or a simulation sees
/// which threads the core started and runs them at a point of its choosing, on its own thread.
#[derive(Default)]
pub struct Queue {
    work: Mutex<VecDeque<(String, Work)>>,
}

impl Queue {
    pub fn new() -> Queue {
        Queue::default()
    }

    /// The names of the work waiting, oldest first.
    pub fn waiting(&self) -> Vec<String> {
        let q = self.work.lock().expect("spawn queue");
        q.iter().map(|(n, _)| n.clone()).collect()
    }

    /// Drops the work waiting under `name` unrun (a thread the test does not want to run).
    pub fn discard(&self, name: &str) {
        self.work
            .lock()
            .expect("spawn queue")
            .retain(|(n, _)| n != name);
    }

    /// Runs the oldest work waiting, on the calling thread; its name, `None` if none waits.
    pub fn run_next(&self) -> Option<String> {
        let next = self.work.lock().expect("spawn queue").pop_front();
        next.map(|(name, work)| {
            work();
            name
        })
    }
}

impl Spawn for Queue {
    fn spawn(&self, name: &str, work: Work) -> std::io::Result<()> {
        let mut q = self.work.lock().expect("spawn queue");
        q.push_back((name.into(), work));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;

    #[test]
    fn queued_work_runs_only_when_its_caller_says_in_order() {
        let q = Queue::new();
        let ran = Arc::new(AtomicU32::new(0));
        for (name, bit) in [("a", 1), ("b", 2)] {
            let ran = ran.clone();
            let work = Box::new(move || {
                ran.fetch_or(bit, Ordering::SeqCst);
            });
            q.spawn(name, work).unwrap();
        }
        assert_eq!(ran.load(Ordering::SeqCst), 0);
        assert_eq!(q.waiting(), ["a", "b"]);
        assert_eq!(q.run_next().as_deref(), Some("a"));
        assert_eq!(ran.load(Ordering::SeqCst), 1);
        assert_eq!(q.run_next().as_deref(), Some("b"));
        assert_eq!(q.run_next(), None);
        assert_eq!(ran.load(Ordering::SeqCst), 3);
    }

    #[test]
    fn an_os_thread_runs_its_work() {
        let (tx, rx) = std::sync::mpsc::channel();
        Threads
            .spawn("test", Box::new(move || tx.send(7).unwrap()))
            .unwrap();
        assert_eq!(rx.recv().unwrap(), 7);
    }
}
