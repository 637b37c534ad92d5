//! What a mount keeps between requests besides the kernel's own caches: its open files' data
//! paths, attributes the primary answered its own changes with, and what it answers itself
//! under its watcher's lease ([`crate::leased`]). The watcher ([`crate::watch`]) makes them forget (or learn) what
//! other mounts change, before those changes are answered, exactly as it makes the kernel
//! forget.
//!
//! Invariant of [`LearntAttrs`]: it holds at most the attributes the mount's last change was
//! answered with, and only if nothing that could change them finished (on this mount: any
//! change but one of another inode's own attributes, such as a chmod of a file in a directory
//! learnt) or was heard of (from the watcher) between the moment that request was sent and
//! the moment it was kept, or since; they are served at most once, within the mount's `attr_timeout` of
//! being learnt, so they are never staler than the kernel's own cache would be.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rackfs_proto::namespace::{Attr, Change};

use crate::file::FileData;
use crate::leased::Leased;

/// This mount's open files by inode (the watcher forgets their sizes on change).
pub type Files = Arc<Mutex<HashMap<u64, Arc<FileData>>>>;

/// The mount's caches, shared by the filesystem and its watcher.
#[derive(Clone, Default)]
pub struct Caches {
    pub files: Files,
    pub attrs: Arc<LearntAttrs>,
    pub leased: Arc<Leased>,
}

impl Caches {
    /// The watcher lost touch with what changed: forget everything this mount answers
    /// itself.
    pub fn forget_all(&self) {
        self.leased.forget_all();
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
    /// Bumped by everything that may make a kept attribute stale.
    generation: u64,
}

impl LearntAttrs {
    /// The generation to hand to [`LearntAttrs::keep`] for a request sent now.
    pub fn generation(&self) -> u64 {
        self.0.lock().expect("learnt attrs lock").generation
    }

    /// Keeps `attrs` (and nothing else: the change may have touched other inodes, a removed
    /// directory for one), answered to a change sent at generation `sent`, learnt at `now`;
    /// keeps nothing if anything else changed meanwhile. Either way this change is one more.
    pub fn keep(&self, attrs: Attr, sent: u64, now: u64) {
        let mut l = self.0.lock().expect("learnt attrs lock");
        l.attrs.clear();
        if l.generation == sent {
            l.attrs.insert(attrs.ino, (attrs, now));
        }
        l.generation += 1;
    }

    /// This mount made a change whose answer says nothing of attributes: forget them all.
    pub fn changed(&self) {
        let mut l = self.0.lock().expect("learnt attrs lock");
        l.attrs.clear();
        l.generation += 1;
    }

    /// Another mount changed `ino`, or this mount changed `ino`'s own attributes alone.
    pub fn forget(&self, ino: u64) {
        let mut l = self.0.lock().expect("learnt attrs lock");
        l.attrs.remove(&ino);
        l.generation += 1;
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
        l.keep(dir(5, 1), g, 100);
        assert_eq!(l.take(5, 200, TTL), Some(dir(5, 1)));
        assert_eq!(l.take(5, 200, TTL), None, "served once");
        let g = l.generation();
        l.keep(dir(5, 2), g, 100);
        assert_eq!(l.take(5, 100 + TTL.as_nanos() as u64, TTL), None);
    }

    #[test]
    fn a_change_between_send_and_answer_drops_the_answer() {
        let l = LearntAttrs::default();
        let (a, b) = (l.generation(), l.generation());
        // Two creates in flight: the second answered first is kept, the first is dropped
        // (its answer may predate the second's change).
        l.keep(dir(5, 2), b, 10);
        l.keep(dir(5, 1), a, 11);
        assert_eq!(l.take(5, 12, TTL), None);
        // Another change of this mount or another mount's, finished meanwhile.
        for stale in [
            |l: &LearntAttrs| l.changed(),
            |l: &LearntAttrs| l.forget(5),
            |l: &LearntAttrs| l.forget(9),
        ] {
            let g = l.generation();
            stale(&l);
            l.keep(dir(5, 3), g, 20);
            assert_eq!(l.take(5, 21, TTL), None);
        }
        // Another mount's change of a name in the directory, heard after keeping, drops it.
        let c = Caches {
            files: Files::default(),
            attrs: Arc::new(l),
            leased: Arc::default(),
        };
        let g = c.attrs.generation();
        c.attrs.keep(dir(5, 4), g, 30);
        c.forget(&Change::Entry {
            parent: 5,
            name: b"x".to_vec(),
        });
        assert_eq!(c.attrs.take(5, 31, TTL), None);
    }
}
