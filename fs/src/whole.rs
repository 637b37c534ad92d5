//! Directories this mount holds whole: it made them, so it knows every name that may exist in
//! them, and answers a lookup of any other name there as absent without asking the primary
//! (the lookup the kernel makes before every create, mkdir or rename onto a new name).
//!
//! Invariants:
//! * A directory is held only if the primary registered it for this mount's watcher when it
//!   made it (`rackfs_memnode::watch`): from then on every creation there by another mount is
//!   pushed to the watcher ([`Change::Created`]) and, unless the watcher lags, acknowledged
//!   before it returns. The names a directory holds are those this mount sent a create of
//!   (added before sending) and those the watcher heard of (renamed in or removed: a name
//!   that may exist is a name to ask the primary about). A creation there by another mount
//!   drops the directory instead: it is shared, and holding it would make every create there
//!   wait for this mount's watcher.
//! * Absence is answered only under the watcher's lease: until `ttl` (the mount's
//!   `attr_timeout`, the longest the primary waits for this watcher) after sending a poll
//!   whose answer was applied, less a tenth for the clocks' drift. The primary waits for an
//!   acknowledgement of a change until `ttl` after making it, later than the poll was sent, so
//!   a mount that stops (paused, cut off) stops answering from here before a change it missed
//!   returns. A lagging watcher, a lost poll or one that reports dropped changes, and a new
//!   watcher connection (the primary knows nothing of this mount's directories then) forget
//!   every directory; so does anything between sending a mkdir and holding what it made.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

use rackfs_proto::namespace::Change;

/// Directories held at most; the oldest is dropped beyond (and the primary told).
pub const MAX_DIRS: usize = 4096;
/// Names known in one directory at most; beyond, the directory is dropped.
pub const MAX_NAMES: usize = 65_536;

/// See the module docs.
#[derive(Default)]
pub struct WholeDirs(Mutex<Whole>);

#[derive(Default)]
struct Whole {
    /// Names that may exist, by directory.
    dirs: HashMap<u64, HashSet<Vec<u8>>>,
    /// Held directories, oldest first (some may have gone from `dirs` since).
    order: VecDeque<u64>,
    /// Dropped since the watcher's last poll: it tells the primary.
    dropped: Vec<u64>,
    /// Until when (the mount's `mono_ns`) absence may be answered.
    lease_until: u64,
    /// Bumped by every forgetting and by everything the watcher hears.
    generation: u64,
}

impl WholeDirs {
    /// For a mkdir sent at `now`: the generation to hand to [`WholeDirs::hold`] with its
    /// answer, or `None` if the lease has lapsed (the primary may not hold it for us).
    pub fn generation(&self, now: u64) -> Option<u64> {
        let w = self.0.lock().expect("whole dirs lock");
        (now < w.lease_until).then_some(w.generation)
    }

    /// A number that changes whenever the watcher hears anything (or forgets all): an
    /// answer to a request sent at one value is as fresh as the watcher's news if it is
    /// still the value when the answer arrives.
    pub fn news(&self) -> u64 {
        self.0.lock().expect("whole dirs lock").generation
    }

    /// Holds directory `dir`, made by a mkdir sent at generation `sent`, if nothing was heard
    /// or forgotten since (a name pushed for it meanwhile would be missed).
    pub fn hold(&self, dir: u64, sent: Option<u64>) {
        let mut w = self.0.lock().expect("whole dirs lock");
        if sent != Some(w.generation) {
            return;
        }
        w.dirs.insert(dir, HashSet::new());
        w.order.push_back(dir);
        while w.dirs.len() > MAX_DIRS {
            let Some(old) = w.order.pop_front() else {
                break;
            };
            if w.dirs.remove(&old).is_some() {
                w.dropped.push(old);
            }
        }
        if w.order.len() > 2 * MAX_DIRS {
            let Whole { dirs, order, .. } = &mut *w;
            order.retain(|d| dirs.contains_key(d));
        }
    }

    /// Whether `name` is surely absent from `parent` at `now` (the mount's `mono_ns`).
    pub fn absent(&self, parent: u64, name: &[u8], now: u64) -> bool {
        let w = self.0.lock().expect("whole dirs lock");
        now < w.lease_until
            && w.dirs
                .get(&parent)
                .is_some_and(|names| !names.contains(name))
    }

    /// `name` may exist in `parent` from now on (this mount is about to create it).
    pub fn may_exist(&self, parent: u64, name: &[u8]) {
        let mut w = self.0.lock().expect("whole dirs lock");
        Self::add(&mut w, parent, name);
    }

    /// The watcher heard of `ch`. Another mount creating in a held directory shares it:
    /// the directory is dropped, so that its creates there stop waiting for this mount.
    pub fn heard(&self, ch: &Change) {
        let mut w = self.0.lock().expect("whole dirs lock");
        w.generation += 1;
        match ch {
            Change::Entry { parent, name } => Self::add(&mut w, *parent, name),
            Change::Created { parent, .. } => {
                if w.dirs.remove(parent).is_some() {
                    w.dropped.push(*parent);
                }
            }
            Change::Inode { .. } => {}
        }
    }

    fn add(w: &mut Whole, parent: u64, name: &[u8]) {
        let Some(names) = w.dirs.get_mut(&parent) else {
            return;
        };
        if names.len() >= MAX_NAMES {
            w.dirs.remove(&parent);
            w.dropped.push(parent);
        } else {
            names.insert(name.to_vec());
        }
    }

    /// The watcher applied the answer to a poll sent at `sent`; the primary waits up to `ttl`
    /// for it.
    pub fn renew(&self, sent: u64, ttl: Duration) {
        let mut w = self.0.lock().expect("whole dirs lock");
        let lease = ttl.as_nanos() as u64 / 10 * 9;
        w.lease_until = w.lease_until.max(sent.saturating_add(lease));
    }

    /// Forgets every directory (the watcher lost changes, or its connection).
    pub fn forget_all(&self) {
        let mut w = self.0.lock().expect("whole dirs lock");
        w.generation += 1;
        w.lease_until = 0;
        let gone: Vec<u64> = w.dirs.drain().map(|(d, _)| d).collect();
        w.dropped.extend(gone);
        w.order.clear();
    }

    /// Directories dropped since the last call, for the primary.
    pub fn take_dropped(&self) -> Vec<u64> {
        std::mem::take(&mut self.0.lock().expect("whole dirs lock").dropped)
    }

    /// Directories held now.
    pub fn held(&self) -> usize {
        self.0.lock().expect("whole dirs lock").dirs.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TTL: Duration = Duration::from_secs(1);
    const S: u64 = 1_000_000_000;

    fn leased() -> WholeDirs {
        let w = WholeDirs::default();
        w.renew(0, TTL);
        w
    }

    #[test]
    fn a_held_directory_answers_absence_of_names_it_does_not_know_only_under_the_lease() {
        let w = leased();
        w.hold(5, w.generation(1));
        assert!(w.absent(5, b"a", 2));
        w.may_exist(5, b"a");
        assert!(!w.absent(5, b"a", 2), "its own create");
        w.heard(&Change::Entry {
            parent: 5,
            name: b"c".to_vec(),
        });
        assert!(!w.absent(5, b"c", 2), "renamed in");
        assert!(!w.absent(6, b"a", 2), "a directory not held");
        assert!(w.absent(5, b"z", S * 9 / 10 - 1));
        assert!(!w.absent(5, b"z", S * 9 / 10), "the lease lapsed");
        w.renew(S / 2, TTL);
        assert!(w.absent(5, b"z", S));
        // Another mount creates there: the directory is shared, and dropped.
        w.heard(&Change::Created {
            parent: 5,
            name: b"b".to_vec(),
        });
        assert!(!w.absent(5, b"b", S));
        assert!(!w.absent(5, b"z", S));
        assert_eq!(w.take_dropped(), vec![5]);
    }

    #[test]
    fn anything_heard_between_a_mkdirs_sending_and_its_answer_keeps_it_unheld() {
        let w = leased();
        let g = w.generation(1);
        w.heard(&Change::Created {
            parent: 9,
            name: b"x".to_vec(),
        });
        w.hold(9, g);
        assert!(!w.absent(9, b"y", 2));
        // Sent without a lease: not held either.
        let w = WholeDirs::default();
        let g = w.generation(1);
        w.renew(0, TTL);
        w.hold(9, g);
        assert!(!w.absent(9, b"y", 2));
    }

    #[test]
    fn forgetting_all_drops_every_directory_and_the_lease_and_tells_the_primary() {
        let w = leased();
        w.hold(5, w.generation(1));
        w.hold(6, w.generation(1));
        w.forget_all();
        assert!(!w.absent(5, b"a", 2));
        w.renew(0, TTL);
        assert!(!w.absent(5, b"a", 2), "a new lease holds nothing old");
        let mut d = w.take_dropped();
        d.sort();
        assert_eq!(d, vec![5, 6]);
        assert!(w.take_dropped().is_empty());
    }

    #[test]
    fn the_oldest_directory_goes_beyond_the_cap() {
        let w = leased();
        for d in 0..MAX_DIRS as u64 + 3 {
            w.hold(d, w.generation(1));
        }
        assert_eq!(w.held(), MAX_DIRS);
        assert_eq!(w.take_dropped(), vec![0, 1, 2]);
        assert!(!w.absent(0, b"a", 2));
        assert!(w.absent(3, b"a", 2));
    }
}
