//! What a mount keeps between requests besides the kernel's own caches: its open files' data
//! paths, attributes the primary answered its own changes with, and what it answers itself
//! under its watcher's lease ([`crate::leased`]). The watcher ([`crate::watch`]) makes them forget (or learn) what
//! other mounts change, before those changes are answered, exactly as it makes the kernel
//! forget.
//!
//! Invariant of [`LearntAttrs`]: it holds a directory's attributes that one of the mount's
//! changes in it was answered with, and only if nothing that could change them finished (on
//! this mount: a change in that directory or of its own attributes, or a change whose reach
//! the mount does not know, such as a rename) or was heard of (from the watcher) between the
//! moment that request was sent and the moment it was kept, or since; they are served at most
//! once, within the mount's `attr_timeout` of being learnt, so they are never staler than the
//! kernel's own cache would be.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rackfs_proto::namespace::{Attr, Change};
use rustc_hash::FxHashMap;

use crate::file::FileData;
use crate::kept::Kept;
use crate::leased::Leased;

/// This mount's open files by inode (the watcher forgets their sizes on change).
pub type Files = Arc<Mutex<FxHashMap<u64, Arc<FileData>>>>;

/// The mount's caches, shared by the filesystem and its watcher.
#[derive(Clone, Default)]
pub struct Caches {
    pub files: Files,
    pub attrs: Arc<LearntAttrs>,
    pub leased: Arc<Leased>,
    /// Opens kept past their last close: a change heard of a file gives its open back.
    pub kept: Arc<Kept>,
}

impl Caches {
    /// The watcher lost touch with what changed: forget everything this mount answers
    /// itself.
    pub fn forget_all(&self) {
        self.leased.forget_all();
        self.kept.doom_all();
        for f in self.files.lock().expect("files lock").values() {
            f.forget_hints();
        }
        self.attrs.changed();
    }

    /// Another mount changed something: forget what this mount knew of it.
    pub fn forget(&self, ch: &Change) {
        self.leased.heard(ch);
        match ch {
            // A name changed: its directory's times did too.
            Change::Entry { parent, .. } | Change::Created { parent, .. } => {
                self.attrs.forget(*parent)
            }
            Change::Inode { ino } => {
                self.kept.doom(*ino);
                if let Some(f) = self.files.lock().expect("files lock").get(ino) {
                    f.forget_size();
                }
                self.attrs.forget(*ino);
            }
            Change::Blocks { ino } => self.attrs.forget(*ino),
        }
    }
}

/// Attributes the primary answered this mount's own changes with (a directory's, after a
/// create or an unlink in it). The kernel drops a directory's attributes whenever this mount
/// changes it and asks for them again at the next path walk; the answer already said them.
#[derive(Default)]
pub struct LearntAttrs(Mutex<Learnt>);

#[derive(Default)]
struct Learnt {
    /// Attributes by inode, with when they were learnt (the mount's `mono_ns`).
    attrs: HashMap<u64, (Attr, u64)>,
    /// Counts the events that may make a kept attribute stale.
    generation: u64,
    /// The generation of the last event that touched each inode (at most [`TOUCHED_KEPT`]).
    touched: HashMap<u64, u64>,
    /// The generation of the last event that may have touched any inode.
    all: u64,
}

/// Inodes whose last touch [`LearntAttrs`] remembers; past that it forgets everything.
const TOUCHED_KEPT: usize = 4096;

impl Learnt {
    /// One more event, touching `ino` (`None`: any inode).
    fn touch(&mut self, ino: Option<u64>) {
        self.generation += 1;
        match ino {
            Some(ino) if self.touched.len() < TOUCHED_KEPT => {
                self.attrs.remove(&ino);
                self.touched.insert(ino, self.generation);
            }
            _ => {
                self.attrs.clear();
                self.touched.clear();
                self.all = self.generation;
            }
        }
    }

    /// Whether nothing touched `ino` after generation `sent`.
    fn untouched_since(&self, ino: u64, sent: u64) -> bool {
        self.all <= sent && self.touched.get(&ino).is_none_or(|&g| g <= sent)
    }
}

impl LearntAttrs {
    /// The generation to hand to [`LearntAttrs::keep`] for a request sent now.
    pub fn generation(&self) -> u64 {
        self.0.lock().expect("learnt attrs lock").generation
    }

    /// Keeps a directory's attributes `attrs`, answered to a change in it sent at generation
    /// `sent`, learnt at `now`, unless anything else touched it meanwhile; `alone`: the change
    /// touched no other inode's attributes a mount may keep (a create or unlink of a name in
    /// it; a removed directory's are touched). Either way this change is one more event.
    pub fn keep(&self, attrs: Attr, alone: bool, sent: u64, now: u64) {
        let mut l = self.0.lock().expect("learnt attrs lock");
        let kept = l.untouched_since(attrs.ino, sent);
        let ino = attrs.ino;
        l.touch(alone.then_some(ino));
        if kept {
            l.attrs.insert(ino, (attrs, now));
        }
    }

    /// This mount made a change whose answer says nothing of attributes: forget them all.
    pub fn changed(&self) {
        self.0.lock().expect("learnt attrs lock").touch(None);
    }

    /// Another mount changed `ino`, or this mount changed `ino`'s own attributes alone.
    pub fn forget(&self, ino: u64) {
        self.0.lock().expect("learnt attrs lock").touch(Some(ino));
    }

    /// `ino`'s attributes if learnt within `ttl` of `now`, once.
    pub fn take(&self, ino: u64, now: u64, ttl: Duration) -> Option<Attr> {
        let (a, at) = self
            .0
            .lock()
            .expect("learnt attrs lock")
            .attrs
            .remove(&ino)?;
        (now.saturating_sub(at) < ttl.as_nanos() as u64).then_some(a)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rackfs_proto::namespace::Kind;

    fn dir(ino: u64, mtime_ns: u64) -> Attr {
        Attr {
            ino,
            kind: Kind::Dir,
            perm: 0o755,
            nlink: 2,
            uid: 0,
            gid: 0,
            size: 4096,
            atime_ns: 0,
            mtime_ns,
            ctime_ns: mtime_ns,
            rdev: 0,
            layout: None,
            allocated: 0,
        }
    }

    const TTL: Duration = Duration::from_secs(1);

    #[test]
    fn learnt_attributes_are_served_once_and_only_within_the_ttl() {
        let l = LearntAttrs::default();
        let g = l.generation();
        l.keep(dir(5, 1), true, g, 100);
        assert_eq!(l.take(5, 200, TTL), Some(dir(5, 1)));
        assert_eq!(l.take(5, 200, TTL), None, "served once");
        let g = l.generation();
        l.keep(dir(5, 2), true, g, 100);
        assert_eq!(l.take(5, 100 + TTL.as_nanos() as u64, TTL), None);
    }

    #[test]
    fn a_change_between_send_and_answer_drops_the_answer() {
        let l = LearntAttrs::default();
        let (a, b) = (l.generation(), l.generation());
        // Two creates in flight: the second answered first is kept, the first is dropped
        // (its answer may predate the second's change).
        l.keep(dir(5, 2), true, b, 10);
        l.keep(dir(5, 1), true, a, 11);
        assert_eq!(l.take(5, 12, TTL), None);
        // Another change of this mount's or another mount's that may touch it, finished
        // meanwhile.
        for stale in [
            |l: &LearntAttrs| l.changed(),
            |l: &LearntAttrs| l.forget(5),
            |l: &LearntAttrs| l.keep(dir(5, 9), true, 0, 0),
            |l: &LearntAttrs| l.keep(dir(7, 9), false, 0, 0),
        ] {
            let g = l.generation();
            stale(&l);
            l.keep(dir(5, 3), true, g, 20);
            assert_eq!(l.take(5, 21, TTL), None);
        }
        // Another mount's change of a name in the directory, heard after keeping, drops it.
        let c = Caches {
            files: Files::default(),
            attrs: Arc::new(l),
            leased: Arc::default(),
            kept: Arc::default(),
        };
        let g = c.attrs.generation();
        c.attrs.keep(dir(5, 4), true, g, 30);
        c.forget(&Change::Entry {
            parent: 5,
            name: b"x".to_vec(),
        });
        assert_eq!(c.attrs.take(5, 31, TTL), None);
    }

    /// Threads creating in directories of their own (mdtest's unique-directory mode) keep
    /// each other's answers: a change in one directory leaves another's attributes be.
    #[test]
    fn a_change_in_another_directory_keeps_the_answer() {
        let l = LearntAttrs::default();
        let (a, b) = (l.generation(), l.generation());
        l.keep(dir(7, 1), true, b, 10);
        l.forget(9);
        l.keep(dir(5, 1), true, a, 11);
        assert_eq!(l.take(5, 12, TTL), Some(dir(5, 1)));
        assert_eq!(l.take(7, 12, TTL), Some(dir(7, 1)));
        // Past the inodes it remembers touches of, it forgets everything.
        let g = l.generation();
        l.keep(dir(5, 2), true, g, 20);
        for ino in 100..100 + TOUCHED_KEPT as u64 + 1 {
            l.forget(ino);
        }
        assert_eq!(l.take(5, 21, TTL), None);
    }
}
