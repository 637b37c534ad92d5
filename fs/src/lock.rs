//! Range locks on files: Citron trees (`rackfs_locks`) in the primary's memory, one per file.
//!
//! A write locks the 4 KiB units it touches (a sub-unit write locks its whole unit), an
//! O_APPEND write locks from the end of file, `ftruncate` locks the whole file; reads take no
//! lock. The tree is created by the primary on the first lock of a file and *replaced* to grow
//! it (a lock beyond the tree, up to [`MAX_HEIGHT`]), to shrink it (truncate) and to recover
//! it (a mount died holding locks): see `rackfs_meta::locktree`. A mount caches its handle on
//! the published tree and re-reads the file record when an acquisition finds the tree retired
//! or when it has not seen the tree live for `LAYOUT_LEASE` (a quarter of the service's grace, so it
//! never touches a freed tree).
//!
//! With `keep_locks=on` (the default) a mount that writes a file uncontended keeps its whole
//! tree between writes ([`rackfs_locks::keep`]), so its writes take no lock round trip; a
//! `rackfs-keep` thread per kept tree checks every [`KEEP_TICK`] whether another mount waits
//! for a range, and gives the tree back if so (or once the mount wrote nothing under it for
//! the policy's idle time, 20 ms). A mount keeps at most [`KEPT_TREES`] trees at once.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use rackfs_locks::{KeepPolicy, LockError, LockTree, RangeGuard, Tick};
use rackfs_proto::control::ControlResponse;
use rackfs_proto::locktree::{TreeWord, MAX_HEIGHT};
use rackfs_proto::namespace::MetaRequest;
use rackfs_proto::record::REC_LOCKS;
use rackfs_verbs::{block_on, RemoteAddr, VerbsError};

use crate::cluster::Cluster;

/// Bytes per lock unit.
pub const LOCK_UNIT: u64 = 4096;

/// How often a kept tree is checked for waiters: a mount that wants a range of a tree another
/// mount keeps waits about this much longer than behind an ordinary holder.
pub const KEEP_TICK: Duration = Duration::from_millis(1);

/// Most files whose lock trees one mount keeps at once: each costs a thread and a check per
/// [`KEEP_TICK`], so a mount writing many files (a file server) keeps only the busiest few and
/// locks the others per write.
pub const KEPT_TREES: usize = 8;

/// How long a cached tree handle is trusted without seeing the tree live.
const LAYOUT_LEASE: Duration = rackfs_proto::locktree::CLIENT_LEASE;

/// The shape and offset of a published tree.
fn geometry(w: TreeWord) -> Option<(rackfs_locks::Geometry, u64)> {
    w.tree()
        .map(|(height, offset)| (rackfs_locks::Geometry { height }, offset))
}

/// How long one lock request keeps meeting retired trees (a recovery waiting for holders
/// to release) before it gives up with EIO.
const REPLACEMENT_PATIENCE: Duration = Duration::from_secs(60);

struct Tree {
    word: TreeWord,
    /// The primary whose region holds the tree.
    node: u32,
    tree: LockTree,
    /// The mount's session whose lock slot and connection the tree handle uses.
    session: u64,
    /// When an acquisition last saw the tree live (the mount's `mono_ns`).
    seen_live: AtomicU64,
    /// Whether a `rackfs-keep` thread checks the kept tree.
    ticked: AtomicBool,
}

/// A held range of a file; give it back with [`FileLocks::unlock`].
#[must_use = "a range lock is held until unlocked"]
pub struct Held {
    tree: Arc<Tree>,
    guard: RangeGuard,
}

impl Held {
    /// The mount's session the lock was taken in: writes under it must stay in it.
    pub fn session(&self) -> u64 {
        self.tree.session
    }
}

/// The lock state of one file in one mount.
pub struct FileLocks {
    ino: u64,
    record: u64,
    /// Whether this mount keeps the file's tree while it writes uncontended.
    keep: bool,
    tree: RwLock<Option<Arc<Tree>>>,
}

fn errno(cl: &Cluster, node: u32, e: &VerbsError) -> i32 {
    tracing::debug!(node, error = %e, "lock operation failed");
    cl.verbs_errno(node, e)
}

impl FileLocks {
    pub fn new(ino: u64, record: u64, keep: bool) -> FileLocks {
        FileLocks {
            ino,
            record,
            keep,
            tree: RwLock::new(None),
        }
    }

    /// Asks the primary to publish a tree covering `units` in place of `old`.
    fn publish(&self, cl: &Cluster, old: TreeWord, units: u64) -> Result<TreeWord, i32> {
        match cl.meta(MetaRequest::LockTree {
            ino: self.ino,
            old: old.0,
            units,
        }) {
            Ok(ControlResponse::LockTree(w)) => Ok(TreeWord(w)),
            Ok(_) => Err(libc::EIO),
            Err(e) => Err(e.errno()),
        }
    }

    /// The tree to use: the cached one if seen live within the lease, else the published one
    /// (created if the file has none).
    fn current(&self, cl: &Cluster, units: u64) -> Result<Arc<Tree>, i32> {
        if let Some(t) = self.tree.read().expect("tree lock").as_ref() {
            let age = cl
                .clock()
                .mono_ns()
                .saturating_sub(t.seen_live.load(Ordering::Relaxed));
            if age < LAYOUT_LEASE.as_nanos() as u64 && t.session == cl.session() {
                return Ok(t.clone());
            }
        }
        let (slot, cfg, session) = cl.lock_client()?;
        let session_over = cl.session_over();
        let primary = cl.primary_id();
        let p = cl
            .node_in(primary, session)
            .map_err(|e| errno(cl, primary, &e))?;
        let mut word = TreeWord(
            p.qp.faa(RemoteAddr::new(p.rkey, self.record + REC_LOCKS), 0)
                .map_err(|e| errno(cl, primary, &e))?,
        );
        if word.tree().is_none() {
            word = self.publish(cl, TreeWord::NONE, units)?;
        }
        let (geo, offset) = geometry(word).ok_or(libc::EIO)?;
        let mut tree = LockTree::new(
            p.qp.clone(),
            RemoteAddr::new(p.rkey, offset),
            geo,
            cfg,
            slot,
        )
        .give_up_when(session_over);
        if self.keep {
            tree = tree.keeping(KeepPolicy {
                budget: Some(cl.keep_budget()),
                ..KeepPolicy::default()
            });
        }
        let t = Arc::new(Tree {
            word,
            node: primary,
            tree,
            seen_live: AtomicU64::new(cl.clock().mono_ns()),
            ticked: AtomicBool::new(false),
            session,
        });
        *self.tree.write().expect("tree lock") = Some(t.clone());
        Ok(t)
    }

    fn forget(&self, t: &Arc<Tree>) {
        let mut cur = self.tree.write().expect("tree lock");
        if cur.as_ref().is_some_and(|c| Arc::ptr_eq(c, t)) {
            *cur = None;
        }
    }

    /// Locks units `[l, r)` (`r = u64::MAX`: to infinity), growing the tree first if the range
    /// reaches beyond it. Waits while others hold overlapping ranges.
    pub fn lock(&self, cl: &Cluster, l: u64, r: u64) -> Result<Held, i32> {
        let clock = cl.clock();
        let started = clock.now();
        let mut backoff = Duration::from_micros(50);
        while clock.now().saturating_sub(started) < REPLACEMENT_PATIENCE {
            // A new tree is sized for the range (an open-ended one: for its start).
            let t = self.current(cl, if r == u64::MAX { l + 1 } else { r })?;
            let (geo, _) = geometry(t.word).expect("a published tree");
            if r != u64::MAX && r > geo.units() && geo.height < MAX_HEIGHT {
                self.grow(cl, &t, r)?;
                continue;
            }
            match block_on(t.tree.acquire(l, r)) {
                Ok(guard) => {
                    t.seen_live.store(cl.clock().mono_ns(), Ordering::Relaxed);
                    if guard.from_kept() {
                        tick_kept(cl, &t);
                    }
                    let waited = clock.now().saturating_sub(started);
                    cl.metrics().lock_wait.observe(waited);
                    return Ok(Held { tree: t, guard });
                }
                Err(LockError::Retired) => {
                    // Replaced, or being recovered: the new tree is published soon.
                    self.forget(&t);
                    clock.sleep(backoff);
                    backoff = (backoff * 2).min(Duration::from_millis(10));
                }
                Err(LockError::GivenUp) => {
                    // The mount moved to a new session (a primary that took over): its next
                    // attempt finds the tree published there.
                    tracing::debug!(
                        ino = self.ino,
                        "a lock wait in the old session's tree given up"
                    );
                    self.forget(&t);
                }
                Err(LockError::Verbs(e)) => {
                    self.forget(&t);
                    return Err(errno(cl, t.node, &e));
                }
                Err(LockError::Empty(..)) => return Err(libc::EINVAL),
            }
        }
        tracing::warn!(ino = self.ino, "lock tree kept being replaced; giving up");
        Err(libc::EIO)
    }

    /// Scale-up: holding the whole tree, have the primary publish one covering `units`.
    fn grow(&self, cl: &Cluster, t: &Arc<Tree>, units: u64) -> Result<(), i32> {
        let started = cl.clock().now();
        let guard = match block_on(t.tree.acquire(0, u64::MAX)) {
            Ok(g) => g,
            Err(LockError::Retired | LockError::GivenUp) => {
                // Being replaced by someone else (or left with an old session): a moment, then
                // the published tree.
                self.forget(t);
                cl.clock().sleep(Duration::from_millis(1));
                return Ok(());
            }
            Err(e) => {
                tracing::debug!(error = %e, "lock tree growth");
                return Err(libc::EIO);
            }
        };
        let res = self.publish(cl, t.word, units);
        if res.is_ok() {
            t.tree.stop_lending();
        }
        self.forget(t);
        if let Err(e) = block_on(t.tree.release(guard)) {
            tracing::debug!(error = %e, "release after growth");
        }
        give_back_replaced(t);
        let new = res?;
        tracing::debug!(
            ino = self.ino,
            from = ?t.word.tree().map(|(h, _)| h),
            to = ?new.tree().map(|(h, _)| h),
            took = ?cl.clock().now().saturating_sub(started),
            "lock tree grown"
        );
        Ok(())
    }

    /// Scale-down, while holding the whole file (`held` covers `[0, inf)`): replace the tree
    /// by the smallest one covering `units`, returning the rest of its memory.
    pub fn shrink(&self, cl: &Cluster, held: &Held, units: u64) -> Result<(), i32> {
        let (geo, _) = geometry(held.tree.word).expect("a published tree");
        if rackfs_locks::Geometry::for_units(units.max(1)).height >= geo.height {
            return Ok(());
        }
        self.publish(cl, held.tree.word, units)?;
        // Its unlock gives a kept tree back (see `FileLocks::unlock`).
        held.tree.tree.stop_lending();
        self.forget(&held.tree);
        Ok(())
    }

    /// Releases a range (one batch). A failure is logged: the lock's slot then keeps the tree
    /// from being reused until the mount's session ends and recovery replaces the tree.
    pub fn unlock(&self, cl: &Cluster, held: Held) {
        let lent = held.guard.from_kept();
        if let Err(e) = block_on(held.tree.tree.release(held.guard)) {
            tracing::warn!(ino = self.ino, error = %e, "range lock release failed");
            if let LockError::Verbs(e) = e {
                errno(cl, held.tree.node, &e);
            }
        }
        let t = &held.tree;
        if lent && !t.ticked.load(Ordering::Acquire) && t.tree.keeps() {
            // No thread checks the kept tree (none could be started): nobody would learn
            // that another mount waits, so it goes back now.
            if let Err(e) = block_on(t.tree.give_back_kept()) {
                tracing::warn!(node = t.node, error = %e, "giving a kept lock tree back failed");
            }
        }
        if lent {
            give_back_replaced(t);
        }
    }
}

/// Gives back the kept tree this mount replaced (grew or shrank), now that the whole range it
/// was lent for the replacement came back: no ticker would, the tree being retired and never
/// lent from again, and its slot would keep its memory from being freed.
fn give_back_replaced(t: &Tree) {
    if t.tree.replaced() && t.tree.keeps() {
        if let Err(e) = block_on(t.tree.give_back_kept()) {
            tracing::warn!(node = t.node, error = %e, "giving a replaced lock tree back failed");
        }
    }
}

/// Makes sure a `rackfs-keep` thread checks kept tree `t` every [`KEEP_TICK`] until the
/// mount gives it back.
fn tick_kept(cl: &Cluster, t: &Arc<Tree>) {
    if t.ticked.swap(true, Ordering::AcqRel) {
        return;
    }
    let (kept, clock) = (t.clone(), cl.clock().clone());
    let ticker = move || loop {
        let t = &kept;
        clock.sleep(KEEP_TICK);
        match block_on(t.tree.keep_tick()) {
            Ok(Tick::Kept) => continue,
            Ok(Tick::Idle | Tick::Yielded) => {}
            Err(e) => {
                // The next tick tries again; a tree the mount moved on from yields then.
                tracing::debug!(node = t.node, error = %e, "checking a kept lock tree failed");
                continue;
            }
        }
        t.ticked.store(false, Ordering::Release);
        // Kept again meanwhile by a write that found this thread still running: go on.
        if !t.tree.keeps() || t.ticked.swap(true, Ordering::AcqRel) {
            return;
        }
    };
    if let Err(e) = cl.spawn("rackfs-keep", Box::new(ticker)) {
        // The write's unlock gives the tree back (see `FileLocks::unlock`).
        tracing::warn!(error = %e, "no thread to check a kept lock tree: giving it back");
        t.ticked.store(false, Ordering::Release);
    }
}

/// The lock units `[l, r)` covering bytes `[offset, offset + len)`.
pub fn units(offset: u64, len: u64) -> (u64, u64) {
    (offset / LOCK_UNIT, (offset + len).div_ceil(LOCK_UNIT))
}
