//! What a mount answers without asking the primary while its watcher holds its lease: names
//! absent from directories it holds whole, and names and attributes of files it learnt.
//!
//! **The lease.** Answers come from here only until `ttl` (the mount's `attr_timeout`, the
//! longest the primary waits for this watcher's acknowledgement) after sending a poll whose
//! answer was applied, less a tenth for the clocks' drift. The primary waits for an
//! acknowledgement of a change until `ttl` after making it, later than the poll was sent, so a
//! mount that stops (paused, cut off) stops answering from here before a change it missed
//! returns elsewhere. A poll that fails or reports dropped changes, and a new watcher
//! connection (the primary knows nothing of this mount's directories then), forget everything;
//! a watcher that stops polling loses the lease until its next answered poll. An answer is kept only if nothing it tells of (an inode, a name, a directory's
//! names) changed between its sending and its arrival, heard from the watcher or made by this
//! mount, and no change of this mount's that may touch it is in flight; a change's own answer
//! forgets again what it touched, so a read that crossed it is never kept.
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
//! the size and mtime they were learnt with (any write moves them). Its allocation changes
//! with an allocation, a last close or a re-replication (each pushed without waiting: blocks
//! may show a round trip late) and with a node's death (every mount forgets everything).
//! Directories' attributes are not kept (creations are not pushed to every mount).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

use rackfs_proto::namespace::{Attr, Change, Kind, MetaRequest, MAX_NAME};

/// Directories held at most; the oldest is dropped beyond (and the primary told).
pub const MAX_DIRS: usize = 4096;
/// Names known in one held directory at most; beyond, the directory is dropped.
pub const MAX_NAMES: usize = 65_536;
/// Names and attributes known at most; all are forgotten beyond.
pub const MAX_KNOWN: usize = 65_536;
/// Stamps of what changed kept at most; beyond, every answer in flight is refused.
const MAX_STAMPS: usize = 65_536;

/// See the module docs.
#[derive(Default)]
pub struct Leased(Mutex<State>);

/// A change of this mount's in flight: what it may touch ([`Leased::changing`], then
/// [`Leased::answered`]).
#[must_use]
pub struct Flight {
    keys: Vec<Key>,
    /// It removes or replaces a name whose inode is not known.
    blind: bool,
}

/// What a change may have touched, for refusing answers that crossed it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Key {
    Ino(u64),
    Name(u64, Vec<u8>),
    /// Names created or moved in this directory.
    Dir(u64),
}

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
    /// Counts every change heard or made by this mount.
    generation: u64,
    /// The generation at which each key last changed.
    stamps: HashMap<Key, u64>,
    /// Answers to requests sent before this generation are not kept (everything was
    /// forgotten since).
    floor: u64,
    /// Keys this mount's changes in flight may change, with how many.
    in_flight: HashMap<Key, u32>,
}

impl Leased {
    /// The generation to hand to [`Leased::answered`]: read after [`Leased::changing`] and
    /// before sending.
    pub fn news(&self) -> u64 {
        self.lock().generation
    }

    /// Whether the lease runs at `now` (a mkdir sent now is registered for this mount's
    /// watcher, which is there).
    pub fn running(&self, now: u64) -> bool {
        now < self.lock().lease_until
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.0.lock().expect("leased cache lock")
    }

    /// Holds directory `dir`, made by a mkdir sent while the lease ran (`leased`) and
    /// answered quietly (`since`, from [`Leased::answered`]); else tells the primary it is
    /// not held (it may have registered it).
    pub fn hold(&self, dir: u64, leased: bool, since: Option<u64>) {
        let mut s = self.lock();
        let quiet = since.is_some_and(|g| s.quiet(&Key::Dir(dir), g));
        if !leased || !quiet {
            s.dropped.push(dir);
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

    /// Whether `name` is surely absent from `parent` at `now` (the mount's `mono_ns`). A
    /// name the primary would refuse (too long, or with `/` or NUL) is left to it.
    pub fn absent(&self, parent: u64, name: &[u8], now: u64) -> bool {
        let valid = !name.is_empty() && name.len() <= MAX_NAME && !name.contains(&b'/');
        let s = self.lock();
        valid
            && !name.contains(&0)
            && now < s.lease_until
            && s.dirs.get(&parent).is_some_and(|n| !n.contains(name))
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

    /// The inode `name` in `parent` was last known to name, lease or not (it may be stale).
    pub fn ino_of(&self, parent: u64, name: &[u8]) -> Option<u64> {
        self.lock().names.get(&(parent, name.to_vec())).copied()
    }

    /// What is known of inode `ino` at `now` (as [`Leased::lookup`]).
    pub fn attr(&self, ino: u64, now: u64) -> Option<Attr> {
        let s = self.lock();
        (now < s.lease_until).then(|| s.attrs.get(&ino).cloned())?
    }

    /// Keeps `attr` (and its name in `parent`, if it came with one), answered to a request
    /// sent at generation `since`, unless either changed since or a change of this mount
    /// that may touch them is in flight. Directories are not kept.
    pub fn learn(&self, name: Option<(u64, &[u8])>, attr: &Attr, since: u64) {
        let mut s = self.lock();
        let name = name.map(|(p, n)| Key::Name(p, n.to_vec()));
        let quiet = |s: &State, k: &Key| s.quiet(k, since) && !s.in_flight.contains_key(k);
        let ino = Key::Ino(attr.ino);
        if attr.kind == Kind::Dir
            || !quiet(&s, &ino)
            || name.as_ref().is_some_and(|k| !quiet(&s, k))
        {
            return;
        }
        if s.attrs.len() >= MAX_KNOWN || s.names.len() >= MAX_KNOWN {
            s.attrs.clear();
            s.names.clear();
        }
        if let Some(Key::Name(parent, name)) = name {
            s.names.insert((parent, name), attr.ino);
        }
        s.attrs.insert(attr.ino, attr.clone());
    }

    /// A regular file's record no longer holds the size and mtime learnt: forgotten.
    pub fn stale(&self, ino: u64) {
        self.lock().attrs.remove(&ino);
    }

    /// This mount is about to send `req`: what it may change is forgotten (a name it may
    /// create may exist from now on), and nothing of it is kept until it is answered.
    pub fn changing(&self, req: &MetaRequest) -> Flight {
        let mut s = self.lock();
        match req {
            MetaRequest::Create { parent, name, .. }
            | MetaRequest::CreateOpen { parent, name, .. }
            | MetaRequest::Link { parent, name, .. } => s.add(*parent, name),
            MetaRequest::Rename {
                new_parent,
                new_name,
                ..
            } => s.add(*new_parent, new_name),
            _ => {}
        }
        // A name removed or replaced whose inode is not known: whichever inode it named
        // changes its link count, so no attribute is kept across it.
        let unknown = |p: &u64, n: &[u8]| !s.names.contains_key(&(*p, n.to_vec()));
        let blind = match req {
            MetaRequest::Unlink { parent, name, .. } => unknown(parent, name),
            MetaRequest::Rename {
                parent,
                name,
                new_parent,
                new_name,
                ..
            } => unknown(parent, name) || unknown(new_parent, new_name),
            _ => false,
        };
        let flight = Flight {
            keys: s.keys_of(req),
            blind,
        };
        s.forget(&flight);
        for k in &flight.keys {
            *s.in_flight.entry(k.clone()).or_default() += 1;
        }
        flight
    }

    /// The change in `flight`, sent at generation `sent`, was answered: what it may have
    /// changed is forgotten again (a read that crossed it may have kept the state before
    /// it). Returns the generation to keep its own answer with, unless something else
    /// touched what it touches meanwhile.
    pub fn answered(&self, flight: Flight, sent: u64) -> Option<u64> {
        let mut s = self.lock();
        let quiet = flight.keys.iter().all(|k| s.quiet(k, sent));
        for k in &flight.keys {
            if let Some(n) = s.in_flight.get_mut(k) {
                *n -= 1;
                if *n == 0 {
                    s.in_flight.remove(k);
                }
            }
        }
        s.forget(&flight);
        let since = if flight.keys.is_empty() {
            sent
        } else {
            s.generation
        };
        quiet.then_some(since)
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
                    s.stamp(Key::Ino(ino));
                }
                s.stamp(Key::Name(*parent, name.clone()));
                s.stamp(Key::Dir(*parent));
                s.add(*parent, name);
            }
            // Held or not (a mkdir whose answer was lost, a hold refused), the primary stops
            // sending creations there.
            Change::Created { parent, name } => {
                s.stamp(Key::Name(*parent, name.clone()));
                s.stamp(Key::Dir(*parent));
                s.dirs.remove(parent);
                s.dropped.push(*parent);
            }
            Change::Inode { ino } | Change::Blocks { ino } => {
                s.attrs.remove(ino);
                s.stamp(Key::Ino(*ino));
            }
        }
    }

    /// The watcher applied the answer to a poll sent at `sent`; the primary waits up to `ttl`
    /// (whole milliseconds, as sent) for it.
    pub fn renew(&self, sent: u64, ttl: Duration) {
        let mut s = self.lock();
        let lease = ttl.as_millis() as u64 * 900_000;
        s.lease_until = s.lease_until.max(sent.saturating_add(lease));
    }

    /// Forgets everything (the watcher lost changes, or its connection).
    pub fn forget_all(&self) {
        let mut s = self.lock();
        s.forget_everything();
        s.lease_until = 0;
        let gone: Vec<u64> = s.dirs.drain().map(|(d, _)| d).collect();
        s.dropped.extend(gone);
        s.order.clear();
    }

    /// Directories dropped since the last call, for the primary.
    pub fn take_dropped(&self) -> Vec<u64> {
        std::mem::take(&mut self.lock().dropped)
    }

    /// Directories held now.
    #[cfg(test)]
    fn held(&self) -> usize {
        self.lock().dirs.len()
    }
}

impl State {
    /// Whether `key` is unchanged since generation `since`.
    fn quiet(&self, key: &Key, since: u64) -> bool {
        since >= self.floor && self.stamps.get(key).is_none_or(|&g| g <= since)
    }

    fn stamp(&mut self, key: Key) {
        if self.stamps.len() >= MAX_STAMPS {
            self.stamps.clear();
            self.floor = self.generation;
        }
        self.stamps.insert(key, self.generation);
    }

    /// Names, attributes and answers in flight all go.
    fn forget_everything(&mut self) {
        self.generation += 1;
        self.floor = self.generation;
        self.stamps.clear();
        self.names.clear();
        self.attrs.clear();
    }

    /// What `req` may change. A creation of a new name changes nothing known (it only
    /// makes the name one that may exist); a read nothing.
    fn keys_of(&self, req: &MetaRequest) -> Vec<Key> {
        let named = |p: u64, n: &[u8]| {
            let mut v = vec![Key::Name(p, n.to_vec()), Key::Dir(p)];
            v.extend(self.names.get(&(p, n.to_vec())).map(|&i| Key::Ino(i)));
            v
        };
        match req {
            MetaRequest::Link { ino, parent, name } => {
                vec![Key::Ino(*ino), Key::Name(*parent, name.clone())]
            }
            MetaRequest::Unlink { parent, name, .. } | MetaRequest::Rmdir { parent, name } => {
                named(*parent, name)
            }
            MetaRequest::Rename {
                parent,
                name,
                new_parent,
                new_name,
                ..
            } => {
                let mut v = named(*parent, name);
                v.extend(named(*new_parent, new_name));
                v
            }
            MetaRequest::SetAttr { ino, .. }
            | MetaRequest::SetXattr { ino, .. }
            | MetaRequest::RemoveXattr { ino, .. }
            | MetaRequest::Fallocate { ino, .. } => vec![Key::Ino(*ino)],
            MetaRequest::Releases { inos, kept } => {
                inos.iter().chain(kept).map(|&i| Key::Ino(i)).collect()
            }
            _ => Vec::new(),
        }
    }

    /// Forgets and stamps what a change in flight may touch.
    fn forget(&mut self, flight: &Flight) {
        if flight.keys.is_empty() {
            return;
        }
        self.generation += 1;
        for k in &flight.keys {
            match k {
                Key::Ino(i) => {
                    self.attrs.remove(i);
                }
                Key::Name(p, n) => {
                    self.names.remove(&(*p, n.clone()));
                }
                Key::Dir(_) => {}
            }
            self.stamp(k.clone());
        }
        if flight.blind {
            self.attrs.clear();
            self.floor = self.generation;
        }
    }

    /// `name` may exist in held directory `parent` from now on.
    fn add(&mut self, parent: u64, name: &[u8]) {
        let Some(names) = self.dirs.get_mut(&parent) else {
            return;
        };
        if names.len() >= MAX_NAMES {
            self.dirs.remove(&parent);
            self.dropped.push(parent);
        } else {
            names.insert(name.to_vec());
        }
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

    /// Sends `req` as the client does: returns what [`Leased::answered`] says, once `between`
    /// ran while it was in flight.
    fn send(w: &Leased, req: &MetaRequest, between: impl FnOnce()) -> Option<u64> {
        let flight = w.changing(req);
        let sent = w.news();
        between();
        w.answered(flight, sent)
    }

    fn mkdir(parent: u64, name: &[u8]) -> MetaRequest {
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

    fn created(parent: u64, name: &[u8]) -> Change {
        Change::Created {
            parent,
            name: name.to_vec(),
        }
    }

    #[test]
    fn a_held_directory_answers_absence_of_names_it_does_not_know_only_under_the_lease() {
        let w = leased();
        w.hold(5, true, send(&w, &mkdir(1, b"d"), || {}));
        assert!(w.absent(5, b"a", 2));
        let _ = send(&w, &mkdir(5, b"a"), || {});
        assert!(!w.absent(5, b"a", 2), "its own create");
        w.heard(&Change::Entry {
            parent: 5,
            name: b"c".to_vec(),
        });
        assert!(!w.absent(5, b"c", 2), "renamed in");
        assert!(!w.absent(6, b"a", 2), "a directory not held");
        assert!(
            !w.absent(5, &[b'x'; 256], 2),
            "a name too long is the primary's to refuse"
        );
        assert!(w.absent(5, b"z", S * 9 / 10 - 1));
        assert!(!w.absent(5, b"z", S * 9 / 10), "the lease lapsed");
        w.renew(S / 2, TTL);
        assert!(w.absent(5, b"z", S));
        // Another mount creates there: the directory is shared, and dropped.
        w.heard(&created(5, b"b"));
        assert!(!w.absent(5, b"b", S));
        assert!(!w.absent(5, b"z", S));
        assert_eq!(w.take_dropped(), vec![5]);
    }

    #[test]
    fn a_mkdir_is_held_only_if_sent_under_the_lease_and_nothing_came_there_meanwhile() {
        let w = leased();
        let made = send(&w, &mkdir(1, b"d"), || w.heard(&created(9, b"x")));
        w.hold(9, true, made);
        assert!(!w.absent(9, b"y", 2));
        assert_eq!(w.take_dropped(), vec![9, 9], "the primary is told");
        // Changes elsewhere meanwhile (a last close, a create) do not matter.
        let made = send(&w, &mkdir(1, b"d"), || {
            let _ = send(&w, &mkdir(1, b"other"), || {});
            let _ = send(
                &w,
                &MetaRequest::Releases {
                    inos: vec![3],
                    kept: vec![],
                },
                || {},
            );
            w.heard(&created(8, b"x"));
        });
        w.hold(9, true, made);
        assert!(w.absent(9, b"y", 2));
        // Sent without a lease: not held.
        let w = Leased::default();
        let running = w.running(1);
        let made = send(&w, &mkdir(1, b"d"), || w.renew(0, TTL));
        w.hold(9, running, made);
        assert!(!w.absent(9, b"y", 2));
    }

    #[test]
    fn names_and_attributes_learnt_go_with_any_change_of_them() {
        let w = leased();
        let learn = |w: &Leased| {
            let since = send(
                w,
                &MetaRequest::Lookup {
                    parent: 1,
                    name: b"f".to_vec(),
                },
                || {},
            );
            w.learn(Some((1, b"f")), &file(10), since.unwrap());
        };
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
            release: None,
        };
        let chmod = MetaRequest::SetAttr {
            ino: 10,
            set: Default::default(),
        };
        for own in [unlink, chmod] {
            learn(&w);
            let flight = w.changing(&own);
            assert_eq!(w.attr(10, 2), None, "{own:?}");
            let _ = w.answered(flight, w.news());
        }
        // An unlink of a name not known: which inode it named is not known either.
        w.learn(None, &file(11), w.news());
        let _ = send(
            &w,
            &MetaRequest::Unlink {
                parent: 1,
                name: b"unknown".to_vec(),
                release: None,
            },
            || {},
        );
        assert_eq!(w.attr(11, 2), None);
        // A directory's attributes are not kept.
        let dir = Attr {
            kind: Kind::Dir,
            ..file(12)
        };
        w.learn(None, &dir, w.news());
        assert_eq!(w.attr(12, 2), None);
    }

    #[test]
    fn an_answer_that_crossed_a_change_of_what_it_tells_is_not_kept() {
        let w = leased();
        let getattr = MetaRequest::GetAttr { ino: 10 };
        // Another mount's change heard meanwhile.
        let since = send(&w, &getattr, || w.heard(&Change::Inode { ino: 10 }));
        w.learn(None, &file(10), since.unwrap());
        assert_eq!(w.attr(10, 2), None);
        // One of another inode's does not matter.
        let since = send(&w, &getattr, || w.heard(&Change::Inode { ino: 99 }));
        w.learn(None, &file(10), since.unwrap());
        assert_eq!(w.attr(10, 2), Some(file(10)));
        // This mount's chmod in flight: a read answered before it was made is kept neither
        // while it flies nor after.
        let chmod = MetaRequest::SetAttr {
            ino: 10,
            set: Default::default(),
        };
        let flight = w.changing(&chmod);
        let chmod_sent = w.news();
        let read_sent = w.news();
        w.learn(None, &file(10), read_sent);
        assert_eq!(w.attr(10, 2), None, "kept while the chmod flies");
        let _ = w.answered(flight, chmod_sent);
        w.learn(None, &file(10), read_sent);
        assert_eq!(w.attr(10, 2), None, "kept after the chmod was answered");
        // A last close's answer is kept, whatever else happened meanwhile.
        let close = MetaRequest::Releases {
            inos: vec![10],
            kept: vec![],
        };
        let since = send(&w, &close, || {
            let _ = send(
                &w,
                &MetaRequest::Releases {
                    inos: vec![11],
                    kept: vec![],
                },
                || {},
            );
        });
        w.learn(None, &file(10), since.unwrap());
        assert_eq!(w.attr(10, 2), Some(file(10)));
    }

    #[test]
    fn forgetting_all_drops_everything_and_the_lease_and_tells_the_primary() {
        let w = leased();
        w.hold(5, true, send(&w, &mkdir(1, b"a"), || {}));
        w.hold(6, true, send(&w, &mkdir(1, b"b"), || {}));
        let since = w.news();
        w.learn(Some((5, b"f")), &file(10), since);
        w.forget_all();
        assert!(!w.absent(5, b"a", 2));
        w.renew(0, TTL);
        assert!(!w.absent(5, b"a", 2), "a new lease holds nothing old");
        assert_eq!(w.lookup(5, b"f", 2), None);
        w.learn(Some((5, b"f")), &file(10), since);
        assert_eq!(
            w.lookup(5, b"f", 2),
            None,
            "an answer sent before is not kept"
        );
        let mut d = w.take_dropped();
        d.sort();
        assert_eq!(d, vec![5, 6]);
        assert!(w.take_dropped().is_empty());
    }

    #[test]
    fn the_oldest_directory_goes_beyond_the_cap() {
        let w = leased();
        for d in 0..MAX_DIRS as u64 + 3 {
            w.hold(d, true, send(&w, &mkdir(1, b"d"), || {}));
        }
        assert_eq!(w.held(), MAX_DIRS);
        assert_eq!(w.take_dropped(), vec![0, 1, 2]);
        assert!(!w.absent(0, b"a", 2));
        assert!(w.absent(3, b"a", 2));
    }
}
