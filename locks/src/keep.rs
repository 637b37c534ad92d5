//! Keeping a whole tree between one client's requests while nobody else wants any of it
//! (lease-style lock caching, after ShiftLock): an uncontended writer then pays no round trip
//! for its range locks.
//!
//! A client that keeps ([`LockTree::keeping`]) and has had [`KeepPolicy::streak`] acquisitions
//! in a row granted without waiting for anyone, in a burst, takes the whole tree, `[0, inf)`,
//! with an ordinary acquisition and keeps it, if its [`KeepBudget`] has a place left. Its later
//! requests are *lent* ranges of the kept tree, checked only against the ranges it has lent
//! (its own threads' overlapping requests wait for each other, locally); giving one back is
//! local too.
//!
//! **Revocation is one-sided.** Every acquisition that pauses for others adds 1 to the tree's
//! `waiting` word in its next batch and takes it back when it releases or abandons (see
//! [`crate::tree`]). The keeper reads `waiting` and `state` every tick
//! ([`LockTree::keep_tick`]); if anyone but itself waits, or the tree was retired, or nothing
//! was lent for [`KeepPolicy::idle`], it stops lending, waits for its lent ranges to come back
//! and releases the tree with an ordinary release. After a revocation it does not keep this
//! tree again for a backoff that doubles with each revocation, so contended trees stay on
//! Citron's fine-grained path. A waiter thus waits at most a tick, plus the lent ranges'
//! remaining time, longer than behind an ordinary holder.
//!
//! **Safety is Citron's.** A kept tree is an ordinary granted range `[0, inf)` that is held
//! for long; a lent range lies inside it and only the keeper lends. A keeper lends nothing
//! once its client knows it moved on from the tree ([`LockTree::give_up_when`]: its session
//! fenced or over). A keeper stopped past its lease may resume before it knows: then, as for
//! an ordinary holder stopped that long, the data nodes refuse its writes, having fenced its
//! session before the recovery that ignored its slot replaced the tree. Replacements need
//! the whole tree (growth, shrinking) or retire it first (recovery). Another client's
//! replacement waits, so the keeper yields; the keeper's own lends it the whole range and
//! then stops all lending from the replaced tree ([`LockTree::stop_lending`]); a recovery
//! the keeper sees in `state` and yields, which the recovery waits for as for any live
//! holder.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rackfs_verbs::Batch;

use crate::tree::{LockError, LockTree, RangeGuard, RETIRED};

/// When a client keeps a tree, and for how long.
#[derive(Clone, Debug)]
pub struct KeepPolicy {
    /// Acquisitions in a row granted without waiting, each within `idle` of the one before,
    /// before the client keeps the tree.
    pub streak: u32,
    /// A kept tree with nothing lent for this long is released.
    pub idle: Duration,
    /// No keeping of a tree for this long after its first revocation; doubles with each
    /// further one, up to `max_backoff`.
    pub backoff: Duration,
    pub max_backoff: Duration,
    /// Trees kept at once, shared by the trees of one client (`None`: no bound). Each kept
    /// tree costs a check per tick, so a client writing many files keeps only a few.
    pub budget: Option<Arc<KeepBudget>>,
}

impl Default for KeepPolicy {
    fn default() -> Self {
        KeepPolicy {
            streak: 8,
            idle: Duration::from_millis(20),
            backoff: Duration::from_millis(50),
            max_backoff: Duration::from_secs(5),
            budget: None,
        }
    }
}

/// How many more trees a client may keep ([`KeepPolicy::budget`]).
#[derive(Debug)]
pub struct KeepBudget {
    left: AtomicUsize,
}

impl KeepBudget {
    pub fn new(trees: usize) -> Arc<KeepBudget> {
        Arc::new(KeepBudget {
            left: AtomicUsize::new(trees),
        })
    }

    /// Places left.
    pub fn left(&self) -> usize {
        self.left.load(Ordering::Acquire)
    }

    fn take(&self) -> bool {
        self.left
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .is_ok()
    }

    fn give(&self) {
        self.left.fetch_add(1, Ordering::AcqRel);
    }
}

/// What a keeping client knows of its kept tree.
pub(crate) struct Keep {
    policy: KeepPolicy,
    state: Mutex<KeepState>,
}

struct KeepState {
    kept: Option<Kept>,
    /// A whole-tree acquisition to keep is under way.
    taking: bool,
    /// The kept tree is being given back: nothing more is lent.
    yielding: bool,
    /// This client replaced the tree (see [`LockTree::stop_lending`]): every acquisition on
    /// this handle fails with [`LockError::Retired`].
    replaced: bool,
    /// Acquisitions granted in a row without waiting, each within the idle time of the last.
    streak: u32,
    /// When the last one was granted.
    last_granted: Duration,
    /// No keeping before this time (after a revocation).
    not_before: Duration,
    backoff: Duration,
}

struct Kept {
    guard: RangeGuard,
    /// Ranges lent and not given back yet.
    lent: Vec<(u64, u64)>,
    /// When a range was last lent.
    last_lent: Duration,
}

/// What [`LockTree::keep_tick`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tick {
    /// Nothing is kept.
    Idle,
    /// The tree is kept, and nobody else waits for it.
    Kept,
    /// The kept tree was given back: someone waited for it, it was retired, or it was idle.
    Yielded,
}

impl Keep {
    /// Takes a place in the client's budget for a tree to keep.
    fn budget_take(&self) -> bool {
        self.policy.budget.as_ref().is_none_or(|b| b.take())
    }

    /// A kept tree given back (or a place taken for one that was not kept after all).
    fn budget_give(&self) {
        if let Some(b) = &self.policy.budget {
            b.give();
        }
    }

    pub(crate) fn new(policy: KeepPolicy) -> Keep {
        Keep {
            state: Mutex::new(KeepState {
                kept: None,
                taking: false,
                yielding: false,
                replaced: false,
                streak: 0,
                last_granted: Duration::ZERO,
                not_before: Duration::ZERO,
                backoff: policy.backoff,
            }),
            policy,
        }
    }
}

impl Drop for Keep {
    /// A handle dropped while it keeps (its client moved on) gives its place back.
    fn drop(&mut self) {
        let kept = self.state.get_mut().map(|s| s.kept.is_some());
        if kept.unwrap_or(false) {
            self.budget_give();
        }
    }
}

fn overlaps((a, b): (u64, u64), (l, r): (u64, u64)) -> bool {
    a < r && l < b
}

impl LockTree {
    /// This client keeps the whole tree between its requests while nobody else waits for any
    /// of it (see [`crate::keep`]); someone must call [`LockTree::keep_tick`] every so often
    /// (a fraction of a millisecond to a millisecond: it bounds how long others wait).
    pub fn keeping(mut self, policy: KeepPolicy) -> Self {
        self.keep = Some(Box::new(Keep::new(policy)));
        self
    }

    /// Whether the client keeps the whole tree right now.
    pub fn keeps(&self) -> bool {
        self.keep
            .as_ref()
            .is_some_and(|k| k.state.lock().expect("keep lock").kept.is_some())
    }

    fn keep_state(&self) -> std::sync::MutexGuard<'_, KeepState> {
        let keep = self.keep.as_ref().expect("a keeping tree");
        keep.state.lock().expect("keep lock")
    }

    /// [`LockTree::acquire`] for a keeping client: lent from the kept tree, or taken whole to
    /// keep, or taken exactly.
    pub(crate) async fn acquire_keeping(&self, l: u64, r: u64) -> Result<RangeGuard, LockError> {
        let poll = self.config().poll;
        let keep = self.keep.as_ref().expect("a keeping tree");
        let policy = &keep.policy;
        enum Next {
            Lent,
            Wait,
            TakeWhole,
            Exact,
        }
        loop {
            // A client that moved on lends nothing: its kept tree may have been recovered.
            if self.moved_on() {
                return Err(LockError::GivenUp);
            }
            let now = self.clock().now();
            let next = {
                let mut guard = self.keep_state();
                let s = &mut *guard;
                if s.replaced {
                    return Err(LockError::Retired);
                }
                match s.kept.as_mut() {
                    // Being taken or given back: wait for the outcome.
                    _ if s.yielding || s.taking => Next::Wait,
                    // One of this client's own requests holds part of it: wait for it here.
                    Some(k) if k.lent.iter().any(|&x| overlaps(x, (l, r))) => Next::Wait,
                    Some(k) => {
                        k.lent.push((l, r));
                        k.last_lent = now;
                        Next::Lent
                    }
                    None if s.streak >= policy.streak
                        && now >= s.not_before
                        && keep.budget_take() =>
                    {
                        s.taking = true;
                        Next::TakeWhole
                    }
                    None => Next::Exact,
                }
            };
            match next {
                Next::Lent => return Ok(RangeGuard::lent(l, r)),
                Next::Wait => self.sleep(poll).await?,
                Next::TakeWhole => {
                    let whole = self.acquire_exact(0, u64::MAX).await;
                    let mut s = self.keep_state();
                    s.taking = false;
                    if whole.is_err() {
                        keep.budget_give();
                    }
                    s.kept = Some(Kept {
                        guard: whole?,
                        lent: Vec::new(),
                        last_lent: now,
                    });
                }
                Next::Exact => {
                    let g = self.acquire_exact(l, r).await?;
                    let now = self.clock().now();
                    let mut s = self.keep_state();
                    let burst = now.saturating_sub(s.last_granted) <= policy.idle;
                    s.streak = match (g.waited(), burst) {
                        (true, _) => 0,
                        (false, true) => s.streak.saturating_add(1),
                        (false, false) => 1,
                    };
                    s.last_granted = now;
                    return Ok(g);
                }
            }
        }
    }

    /// This client published a replacement of the tree while holding all of it (growth,
    /// shrinking): it lends nothing more from it, so its other requests, waiting for the
    /// whole range to come back, retry on the published tree instead of being lent ranges of
    /// a retired one that another client may be granted in the new tree. The kept tree goes
    /// back with [`LockTree::give_back_kept`] once the whole range came back.
    pub fn stop_lending(&self) {
        if self.keep.is_some() {
            self.keep_state().replaced = true;
        }
    }

    /// Whether this client replaced the tree ([`LockTree::stop_lending`]).
    pub fn replaced(&self) -> bool {
        self.keep.is_some() && self.keep_state().replaced
    }

    /// A lent range comes back (to nothing if the client moved on from the tree meanwhile).
    pub(crate) fn give_back(&self, g: RangeGuard) {
        let mut s = self.keep_state();
        if let Some(k) = s.kept.as_mut() {
            if let Some(at) = k.lent.iter().position(|&x| x == g.range) {
                k.lent.swap_remove(at);
            }
        }
    }

    /// The keeper's check: gives the kept tree back if anyone else waits for a range of it,
    /// the tree was retired, or nothing was lent for the policy's idle time. One round trip
    /// (a read of `waiting` and `state`) while it keeps the tree, none otherwise.
    pub async fn keep_tick(&self) -> Result<Tick, LockError> {
        self.check_kept(false).await
    }

    /// Gives the kept tree back now, whoever waits (once its lent ranges come back).
    pub async fn give_back_kept(&self) -> Result<Tick, LockError> {
        self.check_kept(true).await
    }

    async fn check_kept(&self, force: bool) -> Result<Tick, LockError> {
        let Some(keep) = self.keep.as_ref() else {
            return Ok(Tick::Idle);
        };
        let own = match self.keep_state().kept.as_ref() {
            None => return Ok(Tick::Idle),
            Some(k) => k.guard.waited() as u64,
        };
        if self.moved_on() {
            // The client left the tree for good (a new session): nothing is released there,
            // as for any range it held.
            if self.keep_state().kept.take().is_some() {
                keep.budget_give();
            }
            return Ok(Tick::Yielded);
        }
        let mut b = Batch::new();
        let waiting = b.read(self.waiting(), 8);
        let state = b.read(self.state_word(), 8);
        let done = self.exec(b).await?;
        let word = |id| u64::from_le_bytes(done.data(id).expect("read").try_into().expect("8"));
        let wanted = word(waiting).wrapping_sub(own) != 0;
        let retired = word(state) & RETIRED != 0;
        let now = self.clock().now();
        {
            let mut s = self.keep_state();
            let idle = s.kept.as_ref().is_some_and(|k| {
                k.lent.is_empty() && now.saturating_sub(k.last_lent) >= keep.policy.idle
            });
            if s.yielding {
                // Another caller is giving it back.
                return Ok(Tick::Yielded);
            }
            if !(force || wanted || retired || idle) {
                return Ok(Tick::Kept);
            }
            s.yielding = true;
            if wanted || force {
                s.streak = 0;
            }
            if wanted {
                s.not_before = now + s.backoff;
                s.backoff = (s.backoff * 2).min(keep.policy.max_backoff);
            } else {
                s.backoff = keep.policy.backoff;
            }
        }
        // Lent ranges come back once their requests are done; the tree is taken in the same
        // hold of the state that sees none lent (nothing is lent while `yielding`).
        let kept = loop {
            {
                let mut s = self.keep_state();
                if s.kept.as_ref().is_none_or(|k| k.lent.is_empty()) {
                    s.yielding = false;
                    break s.kept.take();
                }
            }
            self.clock().sleep(self.config().poll).await;
        };
        if let Some(k) = kept {
            keep.budget_give();
            self.release_exact(k.guard).await?;
        }
        Ok(Tick::Yielded)
    }
}
