//! Opens a mount keeps past their last close, so that it opens the file again without a
//! round trip to the primary.
//!
//! A last close normally gives the mount's open back ([`crate::releases`]). For up to
//! `kept_opens=` files, the close keeps it instead (`MetaRequest::Releases`' `kept`): the
//! primary settles and trims the file as at a last close when the kept open is the only one
//! left, and counts the open on. The mount's next open of the file takes the kept open
//! itself, and its close keeps it again.
//!
//! Invariants:
//! - While the mount keeps an open of a file, the primary counts it: the file and its memory
//!   stay, even if another mount unlinks it, until the mount gives it back.
//! - A kept open is reused once the primary answered the close that kept it (a trim that
//!   close made is done before any write through it), or before that close is sent (it is
//!   then never sent: to the primary the file stayed open); never while the close is on its
//!   way. Only while the mount's watcher
//!   holds its lease (`crate::leased`), and only if no change of the file's attributes was
//!   heard since (another mount's chmod or unlink, pushed to the watcher, or the watcher
//!   losing changes): such a change dooms it, and the open is given back instead.
//! - A kept open no longer wanted (doomed, or idle for `releases::KEPT_IDLE`) is given back
//!   by the releases' sender within its sweep (`releases::send_given_back`, every 50 ms) or
//!   with the next batch of releases; one whose name this mount unlinks goes with the unlink
//!   (`MetaRequest::Unlink`'s `release`), so the file is freed when the unlink returns.

use std::collections::{BTreeSet, HashMap};
use std::sync::Mutex;

use rackfs_proto::namespace::Attr;

/// What a close does with the mount's open of a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Close {
    /// Gives the open back to the primary.
    Release,
    /// Keeps it: the primary is told the file was closed, and the open is reused later.
    Keep,
}

/// A mount's kept opens (see the module docs).
pub struct Kept {
    /// Files kept at most (0: none).
    cap: usize,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    files: HashMap<u64, Entry>,
    /// The files whose close is queued (ordered, so a batch is the same on every replay).
    queued: BTreeSet<u64>,
    /// Kept opens to give back with the next batch of releases.
    given_back: Vec<u64>,
}

impl State {
    /// Forgets `ino`'s entry.
    fn forget(&mut self, ino: u64) {
        self.files.remove(&ino);
        self.queued.remove(&ino);
    }

    /// Forgets `ino`'s entry and gives its open back with the next batch.
    fn give_back(&mut self, ino: u64) {
        self.forget(ino);
        self.given_back.push(ino);
    }

    /// Gives back every entry `pick` chooses.
    fn give_back_where(&mut self, pick: impl Fn(&Entry) -> bool) {
        let picked: Vec<u64> = self
            .files
            .iter()
            .filter(|(_, e)| pick(e))
            .map(|(&ino, _)| ino)
            .collect();
        for ino in picked {
            self.give_back(ino);
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    use_: Use,
    /// The file's mode when its close was answered (a reopen's handle needs it).
    perm: u16,
    /// When it was last closed (the mount's `mono_ns`).
    since: u64,
    /// A change was heard: given back instead of being reused.
    doomed: bool,
}

impl Entry {
    /// Held by no handle and by no close on its way: it may be given back at once.
    fn unused(&self) -> bool {
        matches!(self.use_, Use::Free | Use::Queued)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Use {
    /// Its close is queued, not sent yet.
    Queued,
    /// Its close is on its way to the primary.
    Sending,
    /// Kept, ready for a reopen.
    Free,
    /// Reopened: a handle of this mount uses it.
    Open,
}

impl Kept {
    /// Keeps at most `cap` files' opens (0: every close gives its open back).
    pub fn new(cap: usize) -> Kept {
        Kept {
            cap,
            state: Mutex::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("kept opens lock")
    }

    /// Takes the kept open of `ino` for a new handle: the file's mode, or `None` if there is
    /// none ready (the caller asks the primary for an open).
    pub fn reopen(&self, ino: u64) -> Option<u16> {
        let mut s = self.lock();
        let e = s.files.get_mut(&ino)?;
        if !e.unused() || e.doomed {
            return None;
        }
        e.use_ = Use::Open;
        let perm = e.perm;
        s.queued.remove(&ino);
        Some(perm)
    }

    /// The last close of a handle of `ino`; `reused`: the handle took the kept open;
    /// `lease`: the mount's lease runs (without it, nothing is kept: it could not be reused).
    pub fn close(&self, ino: u64, reused: bool, lease: bool) -> Close {
        let mut s = self.lock();
        if reused {
            return match s.files.get_mut(&ino) {
                Some(e) if e.use_ == Use::Open && !e.doomed && lease => {
                    e.use_ = Use::Queued;
                    s.queued.insert(ino);
                    Close::Keep
                }
                _ => {
                    s.forget(ino);
                    Close::Release
                }
            };
        }
        if !lease || s.files.contains_key(&ino) || s.files.len() >= self.cap {
            return Close::Release;
        }
        let e = Entry {
            use_: Use::Queued,
            perm: 0,
            since: 0,
            doomed: false,
        };
        s.files.insert(ino, e);
        s.queued.insert(ino);
        Close::Keep
    }

    /// The closes that keep their opens, queued since the last call: on their way now.
    pub fn take_queued(&self) -> Vec<u64> {
        let mut s = self.lock();
        let out: Vec<u64> = std::mem::take(&mut s.queued).into_iter().collect();
        for ino in &out {
            if let Some(e) = s.files.get_mut(ino) {
                e.use_ = Use::Sending;
            }
        }
        out
    }

    /// Closes of [`Kept::take_queued`] that did not reach the primary: queued again.
    pub fn requeue(&self, inos: &[u64]) {
        let mut s = self.lock();
        for &ino in inos {
            if let Some(e) = s.files.get_mut(&ino).filter(|e| e.use_ == Use::Sending) {
                e.use_ = Use::Queued;
                s.queued.insert(ino);
            }
        }
    }

    /// How many closes that keep their opens are queued.
    pub fn queued(&self) -> usize {
        self.lock().queued.len()
    }

    /// The primary answered a close that kept the open of `ino`, with the file's attributes
    /// after it (`None`: it named none). The open is ready for a reopen, or given back if it
    /// was doomed meanwhile.
    pub fn answered(&self, ino: u64, attr: Option<&Attr>, now: u64) {
        let mut s = self.lock();
        let Some(e) = s.files.get_mut(&ino) else {
            return;
        };
        match attr {
            Some(a) if !e.doomed && e.use_ == Use::Sending => {
                e.use_ = Use::Free;
                e.perm = a.perm;
                e.since = now;
            }
            _ if e.use_ == Use::Sending => s.give_back(ino),
            _ => {}
        }
    }

    /// `ino`'s attributes changed elsewhere (or may have): its kept open is given back, now
    /// if it is free, else when its close is answered.
    pub fn doom(&self, ino: u64) {
        let mut s = self.lock();
        if let Some(e) = s.files.get_mut(&ino) {
            e.doomed = true;
            if e.unused() {
                s.give_back(ino);
            }
        }
    }

    /// Every kept open is doomed (the watcher lost changes).
    pub fn doom_all(&self) {
        let mut s = self.lock();
        s.files.values_mut().for_each(|e| e.doomed = true);
        s.give_back_where(Entry::unused);
    }

    /// Takes the kept open of `ino` for an unlink of one of its names to give back: true if
    /// it was free (the caller gives it back with the unlink); else it is doomed.
    pub fn take(&self, ino: u64) -> bool {
        let mut s = self.lock();
        match s.files.get_mut(&ino) {
            // A queued close is never sent: the unlink's release settles the file instead.
            Some(e) if e.unused() => {
                s.forget(ino);
                true
            }
            Some(e) => {
                e.doomed = true;
                false
            }
            None => false,
        }
    }

    /// Gives back every free kept open (an unlink of a name whose inode the mount does not
    /// know: the file may be one of them, and goes when the unlink returns).
    pub fn give_back_free(&self) {
        self.lock().give_back_where(Entry::unused);
    }

    /// This mount changed `ino`'s mode (its own change is not pushed to its watcher).
    pub fn set_perm(&self, ino: u64, perm: u16) {
        if let Some(e) = self.lock().files.get_mut(&ino) {
            e.perm = perm;
        }
    }

    /// Gives back the opens free since before `before` (the mount's `mono_ns`).
    pub fn expire(&self, before: u64) {
        self.lock()
            .give_back_where(|e| e.use_ == Use::Free && e.since < before);
    }

    /// The kept opens to give back now.
    pub fn take_given_back(&self) -> Vec<u64> {
        std::mem::take(&mut self.lock().given_back)
    }

    /// How many files' opens are kept (ready, reopened or being closed).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().files.len()
    }
}

impl Default for Kept {
    fn default() -> Kept {
        Kept::new(DEFAULT_CAP)
    }
}

/// Files whose opens a mount keeps, unless `kept_opens=` says otherwise.
pub const DEFAULT_CAP: usize = 16_384;

#[cfg(test)]
mod tests {
    use super::*;
    use rackfs_proto::namespace::Kind;

    fn attr(ino: u64, perm: u16) -> Attr {
        Attr {
            ino,
            kind: Kind::File,
            perm,
            nlink: 1,
            uid: 0,
            gid: 0,
            size: 0,
            atime_ns: 0,
            mtime_ns: 0,
            ctime_ns: 0,
            rdev: 0,
            layout: None,
            allocated: 0,
        }
    }

    /// Sends the queued closes and has the primary answer them at `now`.
    fn answer(k: &Kept, now: u64) {
        for ino in k.take_queued() {
            k.answered(ino, Some(&attr(ino, 0o640)), now);
        }
    }

    #[test]
    fn a_close_keeps_the_open_and_a_reopen_takes_it_unless_the_close_is_on_its_way() {
        let k = Kept::new(2);
        assert_eq!(k.close(10, false, true), Close::Keep);
        assert_eq!(k.queued(), 1);
        // Reopened before its close was sent: the close is never sent.
        assert_eq!(k.reopen(10), Some(0));
        assert_eq!(k.queued(), 0);
        assert!(k.take_queued().is_empty());
        assert_eq!(k.close(10, true, true), Close::Keep);
        // Closed and reopened again and again before a batch goes: one close queued.
        for _ in 0..1000 {
            assert_eq!(k.reopen(10), Some(0));
            assert_eq!(k.close(10, true, true), Close::Keep);
        }
        assert_eq!(k.queued(), 1);
        assert_eq!(k.take_queued(), vec![10]);
        assert_eq!(k.reopen(10), None, "its close is on its way");
        k.answered(10, Some(&attr(10, 0o640)), 5);
        assert_eq!(k.reopen(10), Some(0o640));
        assert_eq!(k.reopen(10), None, "one handle at a time");
        // Another handle of the same file, opened through the primary, gives its open back.
        assert_eq!(k.close(10, false, true), Close::Release);
        assert_eq!(k.close(10, true, true), Close::Keep);
        // A close that did not reach the primary is queued again.
        let sent = k.take_queued();
        k.requeue(&sent);
        assert_eq!(k.queued(), 1);
        answer(&k, 6);
        assert_eq!(k.reopen(10), Some(0o640));
        assert!(k.take_given_back().is_empty());
    }

    #[test]
    fn no_more_than_the_cap_are_kept_and_none_without_a_lease() {
        let k = Kept::new(1);
        assert_eq!(k.close(1, false, true), Close::Keep);
        assert_eq!(k.close(2, false, true), Close::Release);
        assert_eq!(Kept::new(0).close(1, false, true), Close::Release);
        assert_eq!(
            Kept::new(1).close(1, false, false),
            Close::Release,
            "no lease"
        );
    }

    #[test]
    fn a_change_heard_gives_the_open_back_now_or_once_its_close_is_answered() {
        let k = Kept::new(8);
        for ino in [1, 2, 3, 5] {
            assert_eq!(k.close(ino, false, true), Close::Keep);
        }
        let sent = k.take_queued();
        for ino in [1, 3] {
            k.answered(ino, Some(&attr(ino, 0o644)), 1);
        }
        assert_eq!(k.reopen(3), Some(0o644));
        assert_eq!(k.close(4, false, true), Close::Keep);
        k.doom(1); // free: back now
        k.doom(2); // its close on its way: back once answered
        k.doom(3); // reopened: back at its close
        k.doom(4); // its close queued: back now, the close never sent
        assert_eq!(k.take_given_back(), vec![1, 4]);
        assert_eq!(k.queued(), 0);
        assert_eq!(k.reopen(1), None);
        k.answered(2, Some(&attr(2, 0o644)), 2);
        assert_eq!(k.take_given_back(), vec![2]);
        assert_eq!(k.close(3, true, true), Close::Release);
        // A close the primary answered without the file's attributes is not reused.
        assert!(sent.contains(&5));
        k.answered(5, None, 3);
        assert_eq!(k.take_given_back(), vec![5]);
        assert_eq!(k.len(), 0);
    }

    #[test]
    fn an_unlink_takes_a_free_or_queued_open_and_dooms_one_in_use() {
        let k = Kept::new(8);
        assert_eq!(k.close(1, false, true), Close::Keep);
        assert!(k.take(1), "queued: its close is never sent");
        assert_eq!((k.queued(), k.len()), (0, 0));
        assert_eq!(k.close(1, false, true), Close::Keep);
        let _ = k.take_queued();
        assert!(!k.take(1), "its close is on its way");
        k.answered(1, Some(&attr(1, 0o644)), 1);
        assert_eq!(k.take_given_back(), vec![1], "doomed while closing");
        assert_eq!(k.close(2, false, true), Close::Keep);
        answer(&k, 1);
        assert!(k.take(2));
        assert!(k.len() == 0 && k.take_given_back().is_empty());
        assert!(!k.take(3), "never kept");
    }

    #[test]
    fn idle_opens_expire_and_busy_ones_do_not() {
        let k = Kept::new(8);
        for ino in [1, 2, 3] {
            assert_eq!(k.close(ino, false, true), Close::Keep);
        }
        let _ = k.take_queued();
        k.answered(1, Some(&attr(1, 0o644)), 10);
        k.answered(2, Some(&attr(2, 0o644)), 30);
        k.expire(20);
        assert_eq!(k.take_given_back(), vec![1]);
        assert_eq!(k.len(), 2);
        k.set_perm(2, 0o4755);
        assert_eq!(k.reopen(2), Some(0o4755));
        k.doom_all();
        assert!(k.take_given_back().is_empty(), "none free");
        assert_eq!(k.close(2, true, true), Close::Release, "doomed");
        k.answered(3, Some(&attr(3, 0o644)), 40);
        assert_eq!(
            k.take_given_back(),
            vec![3],
            "doomed while its close was on its way"
        );
        for ino in [6, 7] {
            assert_eq!(k.close(ino, false, true), Close::Keep);
        }
        let _ = k.take_queued();
        k.answered(6, Some(&attr(6, 0o644)), 50);
        assert_eq!(k.close(8, false, true), Close::Keep);
        k.give_back_free();
        let mut back = k.take_given_back();
        back.sort();
        assert_eq!(back, vec![6, 8], "the one on its way stays");
    }
}
