//! Coherence of the mounts' kernel caches: namespace changes pushed to every other mount's
//! watcher, and the changing operation held until they acknowledge.
//!
//! Each mount keeps a watcher connection to the primary polling with `Watch`. When an
//! operation of session S changes the namespace, the primary queues the changes for every
//! watcher of another mount and the operation returns only when each has acknowledged them
//! (its kernel forgot the old names and attributes), or after that watcher's `ttl` (its
//! kernel's cache timeout: past it the kernel forgets on its own). So once a change returns,
//! no other mount shows the old state.
//!
//! Two rules keep this from stalling:
//! * a watcher that misses a deadline is *lagging*: nobody waits for it until it has caught
//!   up (its caches are then bounded by its `ttl` only, as without watchers);
//! * nobody waits for the watcher of a mount that is itself waiting for acknowledgements: that
//!   mount's kernel may hold the directory lock the watcher needs to invalidate an entry, for
//!   the very operation that waits, and two such mounts would wait for each other.
//!
//! A creation ([`Change::Created`]) goes only to the watchers of mounts that hold its directory
//! whole: a mount holds a directory it made ([`Watchers::hold_whole`], under the metadata
//! lock that made it, so no name can appear there unseen) until it says it dropped it
//! ([`Watchers::drop_whole`]) or its watcher goes. Such a mount answers lookups of names it
//! does not know there as absent, while its watcher's polls keep being answered.
//!
//! A change of a file's blocks alone ([`Change::Blocks`]: an allocation, a last close's trim,
//! a re-replication) is queued but waited for by nobody: block counts may show late.
//!
//! The waiting happens outside the metadata lock. Deadlines are on the node's clock.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use rackfs_clock::{Bell, Mutex, SharedClock};

use rackfs_proto::namespace::Change;

/// Changes kept for a lagging watcher before they are dropped (its caches expire anyway).
const MAX_QUEUED: usize = 65_536;

/// The watchers of all mounts, by the mount's main session.
pub struct Watchers {
    state: Mutex<HashMap<u64, Watcher>>,
    changed: Bell,
    clock: SharedClock,
}

struct Watcher {
    /// The watcher's own connection session.
    conn: u64,
    queue: Vec<Change>,
    /// Number of the latest batch of changes queued, and the latest acknowledged.
    queued: u64,
    acked: u64,
    ttl: Duration,
    lagging: bool,
    lost: bool,
    /// Operations of this mount now waiting for acknowledgements.
    waiting: u32,
    /// Directories the mount holds whole: creations in them are pushed to it.
    whole: HashSet<u64>,
}

impl Watchers {
    /// No watchers yet; deadlines on `clock` (the node's).
    pub fn new(clock: SharedClock) -> Watchers {
        Watchers {
            state: Mutex::default(),
            changed: Bell::new(),
            clock,
        }
    }

    /// A watcher's poll: acknowledges changes up to `acked`, then waits up to `poll` for more.
    /// Returns the number to acknowledge them with, the changes, and whether some were lost.
    pub fn watch(
        &self,
        conn: u64,
        of: u64,
        acked: u64,
        ttl: Duration,
        poll: Duration,
    ) -> (u64, Vec<Change>, bool) {
        let deadline = self.clock.now() + poll;
        let mut state = self.state.lock().expect("watchers lock");
        // A new watcher, or the mount's watcher again after its entry went: it knows nothing
        // of what was queued before and holds no directory here; it is told so (`lost`). A
        // new connection of the same watcher takes over from the old one, whose parked poll
        // may have taken changes it never delivered.
        let w = state.entry(of).or_insert_with(|| Watcher {
            conn,
            queue: Vec::new(),
            queued: 0,
            acked: 0,
            ttl,
            lagging: false,
            lost: true,
            waiting: 0,
            whole: HashSet::new(),
        });
        if w.conn != conn {
            w.conn = conn;
            w.lost = true;
        }
        w.ttl = ttl;
        w.acked = w.acked.max(acked.min(w.queued));
        if w.acked == w.queued {
            w.lagging = false;
        }
        self.changed.notify_all();
        loop {
            // Gone (its session ended), or another connection took over: whatever this
            // poll's mount knew may be stale.
            let Some(w) = state.get_mut(&of).filter(|w| w.conn == conn) else {
                return (0, Vec::new(), true);
            };
            let now = self.clock.now();
            if !w.queue.is_empty() || w.lost || now >= deadline {
                let lost = std::mem::take(&mut w.lost);
                return (w.queued, std::mem::take(&mut w.queue), lost);
            }
            state = self
                .changed
                .wait_timeout(state, deadline.saturating_sub(now))
                .0;
        }
    }

    /// Mount `of` made directory `dir` (and holds it whole) if its watcher is here; called
    /// under the metadata lock that made it.
    pub fn hold_whole(&self, of: u64, dir: u64) {
        if let Some(w) = self.state.lock().expect("watchers lock").get_mut(&of) {
            w.whole.insert(dir);
        }
    }

    /// Stripes of many files changed where they live (a node's replicas dropped): every
    /// watcher is told it lost changes, so each mount forgets all it answers itself.
    pub fn forget_everything(&self) {
        let mut state = self.state.lock().expect("watchers lock");
        for w in state.values_mut() {
            w.lost = true;
        }
        self.changed.notify_all();
    }

    /// Mount `of` no longer holds `dirs` whole.
    pub fn drop_whole(&self, of: u64, dirs: &[u64]) {
        if let Some(w) = self.state.lock().expect("watchers lock").get_mut(&of) {
            for d in dirs {
                w.whole.remove(d);
            }
        }
    }

    /// Queues `changes`, made by session `from`, for every other mount's watcher and waits
    /// until each has acknowledged them, passed its `ttl`, or gone (see the module docs);
    /// block counts alone are waited for by nobody.
    pub fn publish(&self, from: u64, changes: Vec<Change>) {
        if changes.is_empty() {
            return;
        }
        let now = self.clock.now();
        let mut state = self.state.lock().expect("watchers lock");
        let mut wait: Vec<(u64, u64, Duration)> = Vec::new();
        let mut queued_any = false;
        for (&of, w) in state.iter_mut().filter(|(&of, _)| of != from) {
            let theirs: Vec<&Change> = changes
                .iter()
                .filter(|c| match c {
                    Change::Created { parent, .. } => w.whole.contains(parent),
                    _ => true,
                })
                .collect();
            if theirs.is_empty() {
                continue;
            }
            let blocks_only = theirs.iter().all(|c| matches!(c, Change::Blocks { .. }));
            if w.queue.len() + theirs.len() > MAX_QUEUED {
                w.queue.clear();
                w.lost = true;
            } else {
                w.queue.extend(theirs.into_iter().cloned());
            }
            w.queued += 1;
            queued_any = true;
            if !blocks_only && !w.lagging && w.waiting == 0 {
                wait.push((of, w.queued, now + w.ttl));
            }
        }
        if wait.is_empty() {
            // Wake the polls only if one has something to take (a lone mount's own watcher
            // would wake for nothing on every change).
            if queued_any {
                self.changed.notify_all();
            }
            return;
        }
        // Counted only if the mount has a watcher now: one that appears while this waits (its
        // watcher reconnected) starts from 0, and one that went and came back starts afresh.
        let counted = state.get_mut(&from).map(|w| w.waiting += 1).is_some();
        self.changed.notify_all();
        loop {
            let now = self.clock.now();
            let mut next: Option<Duration> = None;
            wait.retain(|&(of, seq, deadline)| {
                let Some(w) = state.get_mut(&of) else {
                    return false;
                };
                if w.acked >= seq || w.lagging {
                    return false;
                }
                if now >= deadline {
                    tracing::warn!(
                        session = of,
                        ttl_ms = w.ttl.as_millis() as u64,
                        "a mount's watcher did not acknowledge namespace changes in time; \
                         its kernel cache expires on its own until it catches up"
                    );
                    w.lagging = true;
                    return false;
                }
                next = Some(next.map_or(deadline, |n: Duration| n.min(deadline)));
                true
            });
            let Some(until) = next else { break };
            state = self
                .changed
                .wait_timeout(state, until.saturating_sub(now))
                .0;
        }
        if let (true, Some(w)) = (counted, state.get_mut(&from)) {
            w.waiting = w.waiting.saturating_sub(1);
        }
    }

    /// A connection ended: the watcher it was, or the mount whose main session it was, goes.
    pub fn end_session(&self, session: u64) {
        let mut state = self.state.lock().expect("watchers lock");
        state.retain(|&of, w| of != session && w.conn != session);
        self.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rackfs_clock::SystemClock;
    use std::sync::Arc;

    /// Watchers on the host's clock (their waits are real), and the clock.
    fn watchers() -> (Watchers, SharedClock) {
        let clock: SharedClock = Arc::new(SystemClock::new());
        (Watchers::new(clock.clone()), clock)
    }

    fn unlink(n: u8) -> Vec<Change> {
        vec![Change::Entry {
            parent: 1,
            name: vec![n],
        }]
    }

    #[test]
    fn a_change_returns_once_the_other_watcher_acknowledged_it() {
        let (w, clock) = watchers();
        let w = Arc::new(w);
        let ttl = Duration::from_secs(30);
        // Mount 2's watcher (connection 20) registers.
        assert_eq!(w.watch(20, 2, 0, ttl, Duration::ZERO).1, vec![]);
        let w2 = w.clone();
        let t0 = clock.now();
        let publisher = std::thread::spawn(move || w2.publish(1, unlink(7)));
        let (seq, changes, lost) = w.watch(20, 2, 0, ttl, Duration::from_secs(5));
        assert_eq!((changes, lost), (unlink(7), false));
        clock.sleep(Duration::from_millis(50));
        assert!(
            !publisher.is_finished(),
            "returned before the acknowledgement"
        );
        w.watch(20, 2, seq, ttl, Duration::ZERO);
        publisher.join().unwrap();
        assert!(clock.now() - t0 < ttl);
        // The changer's own watcher is not sent its own changes.
        w.watch(10, 1, 0, ttl, Duration::ZERO);
        let w2 = w.clone();
        let p = std::thread::spawn(move || w2.publish(1, unlink(8)));
        let (seq, changes, _) = w.watch(20, 2, seq, ttl, Duration::from_secs(5));
        assert_eq!(changes, unlink(8));
        w.watch(20, 2, seq, ttl, Duration::ZERO);
        p.join().unwrap();
        assert_eq!(w.watch(10, 1, 0, ttl, Duration::ZERO).1, vec![]);
    }

    #[test]
    fn creations_go_only_to_the_mounts_holding_their_directory_whole() {
        let (w, clock) = watchers();
        let ttl = Duration::from_secs(1);
        let created = |parent| {
            vec![Change::Created {
                parent,
                name: b"n".to_vec(),
            }]
        };
        w.watch(20, 2, 0, ttl, Duration::ZERO);
        w.watch(30, 3, 0, ttl, Duration::ZERO);
        w.hold_whole(2, 40);
        // Mount 3 holds nothing: a creation in 40 is not sent to it, and waits for mount 2
        // only (silent here: its whole ttl).
        let t0 = clock.now();
        w.publish(1, created(40));
        assert!(clock.now() - t0 >= ttl);
        assert_eq!(w.watch(30, 3, 0, ttl, Duration::ZERO).1, vec![]);
        let (seq, changes, _) = w.watch(20, 2, 0, ttl, Duration::ZERO);
        assert_eq!(changes, created(40));
        w.watch(20, 2, seq, ttl, Duration::ZERO);
        // Elsewhere, or once dropped, a creation goes to nobody and waits for nobody.
        w.drop_whole(2, &[40]);
        for dir in [40, 41] {
            let t0 = clock.now();
            w.publish(1, created(dir));
            assert!(clock.now() - t0 < ttl);
        }
        assert_eq!(w.watch(20, 2, seq, ttl, Duration::ZERO).1, vec![]);
        // A watcher that is not there holds nothing.
        w.hold_whole(9, 40);
        w.watch(90, 9, 0, ttl, Duration::ZERO);
        w.publish(1, created(40));
        assert_eq!(w.watch(90, 9, 0, ttl, Duration::ZERO).1, vec![]);
    }

    #[test]
    fn block_counts_are_queued_but_waited_for_by_nobody() {
        let (w, clock) = watchers();
        let ttl = Duration::from_secs(1);
        w.watch(20, 2, 0, ttl, Duration::ZERO);
        let blocks = vec![Change::Blocks { ino: 7 }];
        let t0 = clock.now();
        w.publish(1, blocks.clone());
        assert!(clock.now() - t0 < ttl, "a silent watcher was waited for");
        assert_eq!(w.watch(20, 2, 0, ttl, Duration::ZERO).1, blocks);
    }

    #[test]
    fn a_silent_watcher_is_waited_for_its_ttl_once_then_not_at_all() {
        let (w, clock) = watchers();
        let ttl = Duration::from_secs(1);
        w.watch(20, 2, 0, ttl, Duration::ZERO);
        let t0 = clock.now();
        w.publish(1, unlink(1));
        let waited = clock.now() - t0;
        assert!(waited >= ttl, "{waited:?}");
        let t0 = clock.now();
        w.publish(1, unlink(2));
        assert!(
            clock.now() - t0 < ttl,
            "a lagging watcher is not waited for again"
        );
        // It catches up: waited for again.
        let (seq, changes, _) = w.watch(20, 2, 0, ttl, Duration::ZERO);
        assert_eq!(changes.len(), 2);
        w.watch(20, 2, seq, ttl, Duration::ZERO);
        let t0 = clock.now();
        w.publish(1, unlink(3));
        assert!(clock.now() - t0 >= ttl);
        // A watcher whose connection ended is not waited for.
        w.end_session(20);
        let t0 = clock.now();
        w.publish(1, unlink(4));
        assert!(clock.now() - t0 < ttl);
    }

    /// The changing mount's own watcher registers (it reconnected) while its change waits for
    /// another's acknowledgement: the change still returns, and the watchers keep working (the
    /// count of its waiting changes went below zero, a panic that poisoned every later
    /// change; found by `rackfs up`'s chaos test).
    #[test]
    fn a_watcher_that_registers_while_its_mount_waits_breaks_nothing() {
        let w = Arc::new(watchers().0);
        let ttl = Duration::from_secs(30);
        w.watch(20, 2, 0, ttl, Duration::ZERO);
        let w2 = w.clone();
        let publisher = std::thread::spawn(move || w2.publish(1, unlink(5)));
        let (seq, changes, _) = w.watch(20, 2, 0, ttl, Duration::from_secs(5));
        assert_eq!(changes, unlink(5));
        // Mount 1's watcher appears now, then mount 2 acknowledges.
        w.watch(10, 1, 0, ttl, Duration::ZERO);
        w.watch(20, 2, seq, ttl, Duration::ZERO);
        publisher.join().expect("the change returns");
        let w2 = w.clone();
        let p = std::thread::spawn(move || w2.publish(1, unlink(6)));
        let (seq, changes, _) = w.watch(20, 2, seq, ttl, Duration::from_secs(5));
        assert_eq!(changes, unlink(6));
        w.watch(20, 2, seq, ttl, Duration::ZERO);
        p.join().unwrap();
    }
}
