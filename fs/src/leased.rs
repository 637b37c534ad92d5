//! What a mount answers without asking the primary while its watcher holds its lease: names
//! absent from directories it holds whole, and names and attributes of files it learnt.
//!
//! **The lease.** Answers come from here only until `ttl` (the mount's `attr_timeout`, the
//! longest the primary waits for this watcher's acknowledgement) after sending a poll whose
//! answer was applied, less a tenth for the clocks' drift. The primary waits for an
//! acknowledgement of a change until `ttl` after making it, later than the poll was sent, so a
//! mount that stops (paused, cut off) stops answering from here before a change it missed
//! returns elsewhere. A lagging watcher, a lost poll or one that reports dropped changes, and a
//! new watcher connection (the primary knows nothing of this mount's directories then) forget
//! everything. An answer to a request is kept only if the watcher heard nothing, and this
//! mount changed nothing it could concern, between its sending and its arrival ([`Leased::news`]).
//!
//! **Directories held whole.** The mount made them, so it knows every name that may exist in
//! them and answers a lookup of any other name there as absent (the lookup the kernel makes
//! before every create, mkdir or rename onto a new name). A directory is held only if the
//! primary registered it for this mount's watcher when it made it (`rackfs_memnode::watch`):
//! from then on every creation there by another mount is pushed to the watcher
//! ([`Change::Created`]) and acknowledged before it returns. The names it holds are those this
//! mount sent a create of (added before sending) and those the watcher heard renamed in or
//! removed. A creation there by another mount drops the directory instead: it is shared, and
//! holding it would make every create there wait for this mount's watcher.
//!
//! **Names and attributes known.** A name's inode and a non-directory's attributes, learnt
//! from the primary's answers. Every change of a name (removed, renamed, replaced) and of an
//! inode's attributes but its size, mtime and allocation is pushed to every mount's watcher,
//! which forgets it here. Size and mtime live in the file's record, which data writes update
//! one-sidedly: a regular file's attributes are answered only after a read of its record finds
//! the size and mtime they were learnt with (any write moves the mtime), so its allocation,
//! which changes only with writes, with changes pushed, or at a last close (pushed without
//! waiting), is as fresh as the rest. Directories' attributes are not kept (creations are not
//! pushed to every mount).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

use rackfs_proto::namespace::{Attr, Change, Kind, MetaRequest};

/// Directories held at most; the oldest is dropped beyond (and the primary told).
pub const MAX_DIRS: usize = 4096;
/// Names known in one held directory at most; beyond, the directory is dropped.
pub const MAX_NAMES: usize = 65_536;
/// Names and attributes known at most; all are forgotten beyond.
pub const MAX_KNOWN: usize = 65_536;

/// See the module docs.
#[derive(Default)]
pub struct Leased(Mutex<State>);

#[derive(Default)]
struct State {
    /// Names that may exist, by directory held whole.
    dirs: HashMap<u64, HashSet<Vec<u8>>>,
    /// Held directories, oldest first (some may have gone from `dirs` since).
    order: VecDeque<u64>,
    /// Dropped since the watcher's last poll: it tells the primary.
    dropped: Vec<u64>,
    /// Inodes by name.
    names: HashMap<(u64, Vec<u8>), u64>,
    /// Attributes of non-directories, by inode.
    attrs: HashMap<u64, Attr>,
    /// Until when (the mount's `mono_ns`) answers may come from here.
    lease_until: u64,
    /// Bumped by everything the watcher hears, by this mount's changes, and by forgetting.
    generation: u64,
}

impl Leased {
    /// A number that changes whenever the watcher hears anything, this mount changes
    /// something, or everything is forgotten: hand the value read before sending a request
    /// to [`Leased::hold`] or [`Leased::learn`] with its answer.
    pub fn news(&self) -> u64 {
        self.lock().generation
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.0.lock().expect("leased cache lock")
    }

    /// Holds directory `dir`, made by a mkdir sent at `news` (and `now`, the lease then
    /// running: the primary holds it for this mount only if its watcher was there).
    pub fn hold(&self, dir: u64, news: u64, sent_at: u64) {
        let mut s = self.lock();
        if news != s.generation || sent_at >= s.lease_until {
            return;
        }
        s.dirs.insert(dir, HashSet::new());
        s.order.push_back(dir);
        while s.dirs.len() > MAX_DIRS {
            let Some(old) = s.order.pop_front() else {
                break;
            };
            if s.dirs.remove(&old).is_some() {
                s.dropped.push(old);
            }
        }
        if s.order.len() > 2 * MAX_DIRS {
            let State { dirs, order, .. } = &mut *s;
            order.retain(|d| dirs.contains_key(d));
        }
    }

    /// Whether `name` is surely absent from `parent` at `now` (the mount's `mono_ns`).
    pub fn absent(&self, parent: u64, name: &[u8], now: u64) -> bool {
        let s = self.lock();
        now < s.lease_until && s.dirs.get(&parent).is_some_and(|n| !n.contains(name))
    }

    /// What is known of `name` in `parent` at `now`: a non-directory's attributes, to be
    /// checked against its record if it is a regular file.
    pub fn lookup(&self, parent: u64, name: &[u8], now: u64) -> Option<Attr> {
        let s = self.lock();
        if now >= s.lease_until {
            return None;
        }
        let ino = s.names.get(&(parent, name.to_vec()))?;
        s.attrs.get(ino).cloned()
    }

    /// What is known of inode `ino` at `now` (as [`Leased::lookup`]).
    pub fn attr(&self, ino: u64, now: u64) -> Option<Attr> {
        let s = self.lock();
        (now < s.lease_until).then(|| s.attrs.get(&ino).cloned())?
    }

    /// Keeps `attr` (and its name in `parent`, if it came with one), answered to a request
    /// sent at `news`, if nothing happened since. Directories are not kept.
    pub fn learn(&self, name: Option<(u64, &[u8])>, attr: &Attr, news: u64) {
        let mut s = self.lock();
        if news != s.generation || attr.kind == Kind::Dir {
            return;
        }
        if s.attrs.len() >= MAX_KNOWN || s.names.len() >= MAX_KNOWN {
            s.attrs.clear();
            s.names.clear();
        }
        if let Some((parent, name)) = name {
            s.names.insert((parent, name.to_vec()), attr.ino);
        }
        s.attrs.insert(attr.ino, attr.clone());
    }

    /// A regular file's record read at `size` and `mtime` does not match what was learnt of
    /// it: forgotten.
    pub fn stale(&self, ino: u64) {
        self.lock().attrs.remove(&ino);
    }

    /// This mount is about to send `req`: what it may change is forgotten (a name it may
    /// create may exist from now on). A creation of a new name changes nothing known, so
    /// [`Leased::news`] read before it still holds after.
    pub fn changing(&self, req: &MetaRequest) {
        let mut s = self.lock();
        match req {
            MetaRequest::Create { parent, name, .. }
            | MetaRequest::CreateOpen { parent, name, .. } => {
                Self::add(&mut s, *parent, name);
                return;
            }
            MetaRequest::Lookup { .. }
            | MetaRequest::GetAttr { .. }
            | MetaRequest::ReadDir { .. }
            | MetaRequest::ReadDirPlus { .. }
            | MetaRequest::ReadLink { .. }
            | MetaRequest::Open { .. }
            | MetaRequest::GetXattr { .. }
            | MetaRequest::ListXattr { .. }
            | MetaRequest::StatFs => return,
            _ => {}
        }
        s.generation += 1;
        match req {
            MetaRequest::Link { ino, parent, name } => {
                s.attrs.remove(ino);
                Self::add(&mut s, *parent, name);
            }
            MetaRequest::Unlink { parent, name } => Self::unname(&mut s, *parent, name),
            // A directory's attributes are not kept.
            MetaRequest::Rmdir { parent, name } => {
                s.names.remove(&(*parent, name.to_vec()));
            }
            MetaRequest::Rename {
                parent,
                name,
                new_parent,
                new_name,
                ..
            } => {
                Self::unname(&mut s, *parent, name);
                Self::unname(&mut s, *new_parent, new_name);
                Self::add(&mut s, *new_parent, new_name);
            }
            MetaRequest::SetAttr { ino, .. }
            | MetaRequest::SetXattr { ino, .. }
            | MetaRequest::RemoveXattr { ino, .. }
            | MetaRequest::Fallocate { ino, .. } => {
                s.attrs.remove(ino);
            }
            MetaRequest::Releases { inos } => {
                for ino in inos {
                    s.attrs.remove(ino);
                }
            }
            _ => {}
        }
    }

    /// The name goes, and what is known of its inode (its link count changes); if the name
    /// was not known, neither is which inode it names: every attribute goes.
    fn unname(s: &mut State, parent: u64, name: &[u8]) {
        match s.names.remove(&(parent, name.to_vec())) {
            Some(ino) => {
                s.attrs.remove(&ino);
            }
            None => s.attrs.clear(),
        }
    }

    /// The watcher heard of `ch`. Another mount creating in a held directory shares it:
    /// the directory is dropped, so that its creates there stop waiting for this mount.
    pub fn heard(&self, ch: &Change) {
        let mut s = self.lock();
        s.generation += 1;
        match ch {
            Change::Entry { parent, name } => {
                if let Some(ino) = s.names.remove(&(*parent, name.clone())) {
                    s.attrs.remove(&ino);
                }
                Self::add(&mut s, *parent, name);
            }
            Change::Created { parent, .. } => {
                if s.dirs.remove(parent).is_some() {
                    s.dropped.push(*parent);
                }
            }
            Change::Inode { ino } => {
                s.attrs.remove(ino);
            }
        }
    }

    /// `name` may exist in held directory `parent` from now on.
    fn add(s: &mut State, parent: u64, name: &[u8]) {
        let Some(names) = s.dirs.get_mut(&parent) else {
            return;
        };
        if names.len() >= MAX_NAMES {
            s.dirs.remove(&parent);
            s.dropped.push(parent);
        } else {
            names.insert(name.to_vec());
        }
    }

    /// The watcher applied the answer to a poll sent at `sent`; the primary waits up to `ttl`
    /// for it.
    pub fn renew(&self, sent: u64, ttl: Duration) {
        let mut s = self.lock();
        let lease = ttl.as_nanos() as u64 / 10 * 9;
        s.lease_until = s.lease_until.max(sent.saturating_add(lease));
    }

    /// Forgets everything (the watcher lost changes, or its connection).
    pub fn forget_all(&self) {
        let mut s = self.lock();
        s.generation += 1;
        s.lease_until = 0;
        let gone: Vec<u64> = s.dirs.drain().map(|(d, _)| d).collect();
        s.dropped.extend(gone);
        s.order.clear();
        s.names.clear();
        s.attrs.clear();
    }

    /// Directories dropped since the last call, for the primary.
    pub fn take_dropped(&self) -> Vec<u64> {
        std::mem::take(&mut self.lock().dropped)
    }

    /// Directories held now.
    pub fn held(&self) -> usize {
        self.lock().dirs.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rackfs_proto::namespace::FileLayout;

    const TTL: Duration = Duration::from_secs(1);
    const S: u64 = 1_000_000_000;

    fn leased() -> Leased {
        let w = Leased::default();
        w.renew(0, TTL);
        w
    }

    fn create(parent: u64, name: &[u8]) -> MetaRequest {
        MetaRequest::Create {
            parent,
            name: name.to_vec(),
            kind: rackfs_proto::namespace::NewKind::Dir,
            perm: 0o755,
            uid: 0,
            gid: 0,
        }
    }

    fn file(ino: u64) -> Attr {
        Attr {
            ino,
            kind: Kind::File,
            perm: 0o644,
            nlink: 1,
            uid: 0,
            gid: 0,
            size: 5,
            atime_ns: 0,
            mtime_ns: 7,
            ctime_ns: 7,
            rdev: 0,
            layout: Some(FileLayout {
                node: 0,
                record: 64,
                stripe_unit: 1 << 20,
            }),
            allocated: 4096,
        }
    }

    #[test]
    fn a_held_directory_answers_absence_of_names_it_does_not_know_only_under_the_lease() {
        let w = leased();
        w.hold(5, w.news(), 1);
        assert!(w.absent(5, b"a", 2));
        w.changing(&create(5, b"a"));
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
    fn anything_between_a_mkdirs_sending_and_its_answer_keeps_it_unheld() {
        let w = leased();
        let g = w.news();
        w.heard(&Change::Created {
            parent: 9,
            name: b"x".to_vec(),
        });
        w.hold(9, g, 1);
        assert!(!w.absent(9, b"y", 2));
        // A create of another name changes nothing known: the mkdir is held.
        let g = w.news();
        w.changing(&create(1, b"other"));
        w.hold(9, g, 1);
        assert!(w.absent(9, b"y", 2));
        // Sent without a lease: not held.
        let w = Leased::default();
        let g = w.news();
        w.hold(9, g, 1);
        w.renew(0, TTL);
        assert!(!w.absent(9, b"y", 2));
    }

    #[test]
    fn names_and_attributes_learnt_go_with_any_change_of_them() {
        let w = leased();
        let learn = |w: &Leased| w.learn(Some((1, b"f")), &file(10), w.news());
        learn(&w);
        assert_eq!(w.lookup(1, b"f", 2), Some(file(10)));
        assert_eq!(w.attr(10, 2), Some(file(10)));
        assert_eq!(w.lookup(1, b"f", S), None, "the lease lapsed");
        for change in [
            Change::Inode { ino: 10 },
            Change::Entry {
                parent: 1,
                name: b"f".to_vec(),
            },
        ] {
            learn(&w);
            w.heard(&change);
            assert_eq!(w.lookup(1, b"f", 2), None, "{change:?}");
        }
        let unlink = MetaRequest::Unlink {
            parent: 1,
            name: b"f".to_vec(),
        };
        let chmod = MetaRequest::SetAttr {
            ino: 10,
            set: Default::default(),
        };
        for own in [unlink.clone(), chmod] {
            learn(&w);
            w.changing(&own);
            assert_eq!(w.attr(10, 2), None, "{own:?}");
        }
        // An unlink of a name not known: which inode it named is not known either.
        w.learn(None, &file(11), w.news());
        w.changing(&MetaRequest::Unlink {
            parent: 1,
            name: b"unknown".to_vec(),
        });
        assert_eq!(w.attr(11, 2), None);
        // An answer that crossed a change is not kept; nor is a directory's.
        let g = w.news();
        w.heard(&Change::Inode { ino: 99 });
        w.learn(Some((1, b"f")), &file(10), g);
        assert_eq!(w.lookup(1, b"f", 2), None);
        let dir = Attr {
            kind: Kind::Dir,
            ..file(12)
        };
        w.learn(None, &dir, w.news());
        assert_eq!(w.attr(12, 2), None);
    }

    #[test]
    fn forgetting_all_drops_everything_and_the_lease_and_tells_the_primary() {
        let w = leased();
        w.hold(5, w.news(), 1);
        w.hold(6, w.news(), 1);
        w.learn(Some((5, b"f")), &file(10), w.news());
        w.forget_all();
        assert!(!w.absent(5, b"a", 2));
        w.renew(0, TTL);
        assert!(!w.absent(5, b"a", 2), "a new lease holds nothing old");
        assert_eq!(w.lookup(5, b"f", 2), None);
        let mut d = w.take_dropped();
        d.sort();
        assert_eq!(d, vec![5, 6]);
        assert!(w.take_dropped().is_empty());
    }

    #[test]
    fn the_oldest_directory_goes_beyond_the_cap() {
        let w = leased();
        for d in 0..MAX_DIRS as u64 + 3 {
            w.hold(d, w.news(), 1);
        }
        assert_eq!(w.held(), MAX_DIRS);
        assert_eq!(w.take_dropped(), vec![0, 1, 2]);
        assert!(!w.absent(0, b"a", 2));
        assert!(w.absent(3, b"a", 2));
    }
}
