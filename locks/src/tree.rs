//! Acquiring and releasing ranges on a lock tree with one-sided verbs.
//!
//! Remote memory of a tree, from its base address ([`HEADER_WORDS`] words, then the nodes):
//! `state`, `spill_next`, `spill_serving` (the spillover mutex, a ticket lock for `[N, inf)`),
//! the `maximizer`, one activity counter per client slot ([`CLIENT_SLOTS`]), `waiting`, then
//! the node words in level order. Who writes which bits:
//! * leaf bits: set by the acquirer of exactly those units (masked-CAS 0->1), cleared by it;
//! * `TMax`: incremented by whoever takes a ticket for that node; `TCnt`: by the ticket's owner
//!   when it is done with the node (release or give-up);
//! * `Occ`: toggled on by the current ticket owner (only it may), toggled off by it;
//! * `DMax`: incremented by a notifier; `DCnt`: by the same notifier when it releases or aborts;
//! * `Exp`: unused (see *Replacing a tree* below);
//! * `spill_next`/`spill_serving`: ticket taken / passed by spillover lockers; `maximizer`:
//!   ORed with right bounds beyond `N`;
//! * `state`: only the tree's owner (the memory node daemon) writes it, once, setting
//!   [`RETIRED`];
//! * `slot[c]`: only client `c` changes it: +1 in the first batch of an acquisition, -1 in the
//!   batch that releases the range or abandons the acquisition. It counts that client's
//!   acquisitions in progress and ranges held in this tree.
//! * `waiting`: +1 by an acquisition in the first batch after it first paused for others
//!   (any wait but `Twait`'s), -1 in the batch that releases its range or abandons it. A
//!   client keeping a whole tree ([`crate::keep`]) reads it to learn that someone wants a
//!   range. An acquisition that ends with a verbs error or given up leaves its +1, as it leaves
//!   its slot's: the tree is then replaced when that client's session is recovered.
//!
//! ## Replacing a tree: scale-up, scale-down and recovery
//!
//! A tree is never resized in place. It is *replaced*: the memory node allocates a new tree,
//! publishes its location (the file record), and sets `RETIRED` in the old one. Every batch of
//! an acquisition ends with a read of `state`, and an acquisition is granted only if the read
//! after its last lock-word write shows the tree live; otherwise it fails with
//! [`LockError::Retired`] (its slot given back, its lock words left as they are: a retired tree
//! is never used again) and the caller retries on the published tree. Two invariants make a
//! replacement safe:
//! * **Nothing is granted in a tree after it is retired.** A grant needs a live `state` read
//!   executed after its writes, and `state` never goes back to live.
//! * **The new tree is published only when nothing granted in the old one is still held.**
//!   Scale-up and scale-down are done by a client holding the whole old tree (`[0, inf)`), so
//!   nobody else holds anything in it. Recovery from a dead client is done by the memory node:
//!   it retires the tree first, then waits until every *live* client's slot reads 0, and only
//!   then publishes a fresh tree. A live client's slot is incremented before its first
//!   lock-word write, so a slot that reads 0 after the retirement means that client holds
//!   nothing and can be granted nothing more there; the dead client's slot is ignored,
//!   and so is whatever it left in the lock words.
//!
//! This replaces the paper's in-place scale-up (Exp propagation and DCnt/DMax carry-over): a
//! replacement copies nothing, needs no release-time accounting for holders from before it,
//! and is the same mechanism for growth, shrinking and recovery. Its cost: a scale-up waits
//! for the holders of the moment to release, as a whole-file lock does.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use rackfs_verbs::{Batch, Clock, Completions, QueuePair, RemoteAddr, VerbsError, WrId};

use crate::geometry::{word, Geometry, Node};
use crate::split::{split, Piece};

/// Knobs of the protocol.
#[derive(Clone, Debug)]
pub struct LockConfig {
    /// Most tree nodes one request locks (the split's `k`).
    pub k: usize,
    /// Notification depth: nearest ancestors notified, and descendant levels checked.
    pub m: u32,
    /// Time budget for one round trip; a notifier that takes more than `3 x` this from its
    /// ancestor check to its notification aborts and retries. `Twait` is `3 x` this.
    pub rtt_budget: Duration,
    /// Pause between polls of a word being waited on.
    pub poll: Duration,
    /// Failed attempts at a leaf's bits before the request escalates to the leaf's parent,
    /// whose bakery ticket is fair (starvation avoidance).
    pub leaf_retries: u32,
}

impl Default for LockConfig {
    fn default() -> Self {
        LockConfig {
            k: 2,
            m: 4,
            rtt_budget: Duration::from_micros(20),
            poll: Duration::from_micros(5),
            leaf_retries: 8,
        }
    }
}

impl LockConfig {
    /// The time a checker waits for notifiers that passed its `Occ` unseen.
    pub fn twait(&self) -> Duration {
        self.rtt_budget * 3
    }

    /// A budget from round trips measured on `qp`: 4x the 90th percentile, at least 2 us. (A
    /// notifier that is descheduled past the budget only aborts and retries: correctness does
    /// not depend on the budget, only the abort rate does.)
    pub async fn calibrated(qp: &QueuePair, probe: RemoteAddr) -> Result<LockConfig, VerbsError> {
        let clock = qp.clock();
        let mut rtts = Vec::new();
        for _ in 0..32 {
            let t = clock.now();
            let mut b = Batch::new();
            b.read(probe, 8);
            qp.post(b).await?.check()?;
            rtts.push(clock.now() - t);
        }
        rtts.sort();
        let p90 = rtts[rtts.len() * 9 / 10];
        let budget = (p90 * 4).max(Duration::from_micros(2));
        Ok(LockConfig {
            rtt_budget: budget,
            poll: budget / 4,
            ..LockConfig::default()
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error("lock request for the empty range [{0}, {1})")]
    Empty(u64, u64),
    #[error(
        "the lock tree was replaced (grown, shrunk or recovered): retry on the published tree"
    )]
    Retired,
    #[error("the lock tree was given up: its client moved on (a new session or primary)")]
    GivenUp,
    #[error(transparent)]
    Verbs(#[from] VerbsError),
}

/// A node this client holds, and the ancestors it notified.
#[derive(Debug, Clone)]
struct Held {
    piece: Piece,
    notified: Vec<Node>,
}

/// A held range; give it back with [`LockTree::release`].
#[derive(Debug)]
#[must_use = "a range lock is held until released"]
pub struct RangeGuard {
    pub range: (u64, u64),
    held: Vec<Held>,
    spill: bool,
    /// Whether the acquisition added 1 to `waiting` (its release takes it back).
    pub(crate) signalled: bool,
    /// Lent from the whole tree this client keeps ([`crate::keep`]): nothing remote to release.
    pub(crate) lent: bool,
}

impl RangeGuard {
    /// A range lent from a kept tree.
    pub(crate) fn lent(l: u64, r: u64) -> RangeGuard {
        RangeGuard {
            range: (l, r),
            held: Vec::new(),
            spill: false,
            signalled: false,
            lent: true,
        }
    }

    /// Whether the range was lent from the tree this client keeps.
    pub fn from_kept(&self) -> bool {
        self.lent
    }

    /// Whether the acquisition waited for others (so the range was contended).
    pub fn waited(&self) -> bool {
        self.signalled
    }
}

enum Outcome {
    Got(Held),
    /// A later piece met a holder: give everything back and start over.
    Busy,
    /// A leaf kept failing: lock its parent instead.
    Escalate,
}

/// One client's handle on a lock tree in remote memory.
pub struct LockTree {
    qp: QueuePair,
    clock: Clock,
    base: RemoteAddr,
    geo: Geometry,
    cfg: LockConfig,
    client: u16,
    round_trips: AtomicU64,
    escalations: AtomicU64,
    aborts: AtomicU64,
    rng: Mutex<u64>,
    /// Whether the client has moved on from this tree (see [`LockTree::give_up_when`]).
    moved_on: Option<Box<dyn Fn() -> bool + Send + Sync>>,
    /// The whole tree kept between this client's requests, if it keeps ([`LockTree::keeping`]).
    pub(crate) keep: Option<Box<crate::keep::Keep>>,
}

/// Client slots per tree: at most this many clients (mounts) use one tree at once.
pub const CLIENT_SLOTS: u64 = 64;
/// Words before the node array.
pub const HEADER_WORDS: u64 = 5 + CLIENT_SLOTS;
/// Byte offset of the `waiting` word in a tree.
pub const WAITING_OFFSET: u64 = (4 + CLIENT_SLOTS) * 8;
/// Byte offset of the `state` word in a tree.
pub const STATE_OFFSET: u64 = 0;
/// `state` value of a retired tree.
pub const RETIRED: u64 = 1;

/// Byte offset of client `c`'s slot in a tree.
pub fn slot_offset(c: u16) -> u64 {
    (4 + c as u64) * 8
}

/// Per-acquisition bookkeeping: whether its slot increment has been posted, whether it paused
/// for others, and whether its `waiting` increment has been posted.
#[derive(Default)]
struct Acq {
    registered: bool,
    paused: bool,
    signalled: bool,
}

impl LockTree {
    /// Bytes of remote memory (zeroed) a tree of shape `geo` needs.
    pub fn memory_len(geo: Geometry) -> u64 {
        (HEADER_WORDS + geo.nodes()) * 8
    }

    /// A handle for client slot `client` (unique among the tree's live users, `< CLIENT_SLOTS`).
    pub fn new(
        qp: QueuePair,
        base: RemoteAddr,
        geo: Geometry,
        cfg: LockConfig,
        client: u16,
    ) -> LockTree {
        assert!(cfg.k >= 1 && cfg.m >= 1, "k and m must be positive");
        assert!(
            (client as u64) < CLIENT_SLOTS,
            "client slot {client} out of range"
        );
        let clock = qp.clock();
        LockTree {
            qp,
            clock,
            base,
            geo,
            cfg,
            client,
            round_trips: AtomicU64::new(0),
            escalations: AtomicU64::new(0),
            aborts: AtomicU64::new(0),
            rng: Mutex::new(base.offset ^ 0x9E37_79B9_7F4A_7C15),
            moved_on: None,
            keep: None,
        }
    }

    /// An acquisition waiting in this tree stops with [`LockError::GivenUp`] at its next pause
    /// once `moved_on` says the client left it for good (its session was fenced or replaced,
    /// its primary died): nobody else will release what it waits for there, and the memory
    /// of a dead node may stay mapped and keep answering. What it held or queued for in the
    /// tree is left as is: the tree is not used again.
    pub fn give_up_when(mut self, moved_on: impl Fn() -> bool + Send + Sync + 'static) -> Self {
        self.moved_on = Some(Box::new(moved_on));
        self
    }

    /// Requests this handle escalated from a leaf to its parent.
    pub fn escalations(&self) -> u64 {
        self.escalations.load(Ordering::Relaxed)
    }

    /// Node acquisitions this handle aborted because its notification came later than Twait.
    pub fn aborts(&self) -> u64 {
        self.aborts.load(Ordering::Relaxed)
    }

    /// Batches this handle has posted (each one round trip).
    pub fn round_trips(&self) -> u64 {
        self.round_trips.load(Ordering::Relaxed)
    }

    fn node(&self, n: Node) -> RemoteAddr {
        self.base.add((HEADER_WORDS + self.geo.flat(n)) * 8)
    }
    pub fn geometry(&self) -> Geometry {
        self.geo
    }
    fn state(&self) -> RemoteAddr {
        self.base.add(STATE_OFFSET)
    }
    fn spill_next(&self) -> RemoteAddr {
        self.base.add(8)
    }
    fn spill_serving(&self) -> RemoteAddr {
        self.base.add(16)
    }
    /// The maximizer: ORed with right bounds beyond the tree, so whoever grows it knows how far.
    pub fn maximizer(&self) -> RemoteAddr {
        self.base.add(24)
    }
    fn slot(&self) -> RemoteAddr {
        self.base.add(slot_offset(self.client))
    }
    pub(crate) fn waiting(&self) -> RemoteAddr {
        self.base.add(WAITING_OFFSET)
    }
    pub(crate) fn state_word(&self) -> RemoteAddr {
        self.state()
    }
    pub(crate) fn clock(&self) -> &Clock {
        &self.clock
    }
    pub(crate) fn config(&self) -> &LockConfig {
        &self.cfg
    }

    pub(crate) async fn exec(&self, b: Batch<'_>) -> Result<Completions, VerbsError> {
        self.round_trips.fetch_add(1, Ordering::Relaxed);
        let done = self.qp.post(b).await?;
        done.check()?;
        Ok(done)
    }

    /// A batch of acquisition `a`: its first one starts with the slot increment, the first
    /// after it paused for others with the `waiting` increment.
    fn batch(&self, a: &mut Acq) -> Batch<'static> {
        let mut b = Batch::new();
        if !a.registered {
            b.faa(self.slot(), 1);
            a.registered = true;
        }
        if a.paused && !a.signalled {
            b.faa(self.waiting(), 1);
            a.signalled = true;
        }
        b
    }

    /// Executes a batch of an acquisition with a read of `state` at its end; a retired tree
    /// fails it with [`LockError::Retired`].
    async fn exec_live(&self, mut b: Batch<'_>) -> Result<Completions, LockError> {
        let state = b.read(self.state(), 8);
        let done = self.exec(b).await?;
        if word_of(&done, state) & RETIRED != 0 {
            return Err(LockError::Retired);
        }
        Ok(done)
    }

    /// Step (d) of an acquisition that checked its ancestors at `start`: notifies `notify`;
    /// whether that came later than `twait` after the check (the acquisition must abort).
    async fn notify(
        &self,
        a: &mut Acq,
        notify: &[Node],
        start: Duration,
        twait: Duration,
    ) -> Result<bool, LockError> {
        let mut b = self.batch(a);
        for anc in notify {
            b.masked_faa(self.node(*anc), 1 << word::DMAX_SHIFT, word::BOUNDARY);
        }
        self.exec_live(b).await?;
        Ok(self.clock.now() - start > twait)
    }

    async fn read_word(&self, a: &mut Acq, at: RemoteAddr) -> Result<u64, LockError> {
        let mut b = self.batch(a);
        let id = b.read(at, 8);
        Ok(word_of(&self.exec_live(b).await?, id))
    }

    /// Pauses acquisition `a` for others (holders, or a retry's backoff): its next batch
    /// tells a client keeping the tree that someone waits.
    async fn wait(&self, a: &mut Acq, d: Duration) -> Result<(), LockError> {
        a.paused = true;
        self.sleep(d).await
    }

    pub(crate) fn moved_on(&self) -> bool {
        self.moved_on.as_ref().is_some_and(|f| f())
    }

    /// Pauses, unless (before or after) the client moved on from the tree.
    pub(crate) async fn sleep(&self, d: Duration) -> Result<(), LockError> {
        let moved_on = || self.moved_on();
        if moved_on() {
            return Err(LockError::GivenUp);
        }
        self.clock.sleep(d).await;
        match moved_on() {
            true => Err(LockError::GivenUp),
            false => Ok(()),
        }
    }

    /// A random backoff of up to `max`, so retrying requests do not move in lockstep.
    fn jitter(&self, max: Duration) -> Duration {
        let mut s = self.rng.lock().expect("rng lock");
        *s ^= *s << 13;
        *s ^= *s >> 7;
        *s ^= *s << 17;
        Duration::from_nanos(*s % (max.as_nanos() as u64 + 1))
    }

    /// Locks units `[l, r)`: the part inside the tree by Citron, the part beyond by the
    /// spillover mutex. Waits as long as conflicting holders do. Fails with
    /// [`LockError::Retired`] if the tree is replaced meanwhile (nothing is then held).
    pub async fn acquire(&self, l: u64, r: u64) -> Result<RangeGuard, LockError> {
        if l >= r {
            return Err(LockError::Empty(l, r));
        }
        if self.keep.is_some() {
            return self.acquire_keeping(l, r).await;
        }
        self.acquire_exact(l, r).await
    }

    /// [`LockTree::acquire`] of exactly `[l, r)`, never from a kept tree.
    pub(crate) async fn acquire_exact(&self, l: u64, r: u64) -> Result<RangeGuard, LockError> {
        let mut a = Acq::default();
        let res = self.acquire_in(&mut a, l, r).await;
        if matches!(res, Err(LockError::Retired)) && a.registered {
            // Abandon: the lock words of a retired tree no longer matter, the slot does (and
            // `waiting`, which keepers of the new tree do not read, is kept balanced anyway).
            let mut b = Batch::new();
            b.faa(self.slot(), u64::MAX);
            if a.signalled {
                b.faa(self.waiting(), u64::MAX);
            }
            self.exec(b).await?;
        }
        res.map(|mut g| {
            g.signalled = a.signalled;
            g
        })
    }

    async fn acquire_in(&self, a: &mut Acq, l: u64, r: u64) -> Result<RangeGuard, LockError> {
        let n = self.geo.units();
        let mut pieces = if l < n {
            split(&self.geo, l, r.min(n), self.cfg.k)
        } else {
            Vec::new()
        };
        let spill = r > n;
        if spill {
            let mut b = self.batch(a);
            b.masked_cas(self.maximizer(), 0, 0, r, r);
            self.exec_live(b).await?;
        }
        let mut attempt = 0u32;
        'attempt: loop {
            let mut held: Vec<Held> = Vec::with_capacity(pieces.len());
            if attempt == 0 && pieces.len() > 1 && pieces.iter().all(|p| self.geo.is_leaf(p.node)) {
                if let Some(h) = self.try_leaves_together(a, &pieces).await? {
                    held = h;
                    if !spill || self.acquire_spill(a, false).await? {
                        return Ok(RangeGuard {
                            range: (l, r),
                            held,
                            spill,
                            signalled: false,
                            lent: false,
                        });
                    }
                    self.release_held(&held).await?;
                    held.clear();
                }
            }
            for p in pieces.clone() {
                match self.acquire_piece(a, p, held.is_empty()).await? {
                    Outcome::Got(h) => held.push(h),
                    Outcome::Escalate => {
                        // Lock the parent instead; pieces inside it are covered by it.
                        self.escalations.fetch_add(1, Ordering::Relaxed);
                        let parent = self.geo.ancestors(p.node)[0];
                        let (ps, pe) = self.geo.range(parent);
                        pieces.retain(|q| {
                            let (s, e) = self.geo.range(q.node);
                            !(ps <= s && e <= pe)
                        });
                        pieces.push(Piece {
                            node: parent,
                            mask: 0,
                        });
                        pieces.sort_by_key(|q| self.geo.range(q.node).0);
                        self.release_held(&held).await?;
                        continue 'attempt;
                    }
                    Outcome::Busy => {
                        self.release_held(&held).await?;
                        attempt += 1;
                        let max = self.cfg.rtt_budget * attempt.min(16);
                        let d = self.jitter(max);
                        self.wait(a, d).await?;
                        continue 'attempt;
                    }
                }
            }
            if spill && !self.acquire_spill(a, held.is_empty()).await? {
                self.release_held(&held).await?;
                attempt += 1;
                let d = self.jitter(self.cfg.rtt_budget * attempt.min(16));
                self.wait(a, d).await?;
                continue 'attempt;
            }
            return Ok(RangeGuard {
                range: (l, r),
                held,
                spill,
                signalled: false,
                lent: false,
            });
        }
    }

    /// Takes the spillover mutex; without `blocking`, only if it is free right now.
    async fn acquire_spill(&self, a: &mut Acq, blocking: bool) -> Result<bool, LockError> {
        if blocking {
            let ticket = {
                let mut b = self.batch(a);
                let id = b.faa(self.spill_next(), 1);
                self.exec_live(b).await?.value(id)?
            };
            while self.read_word(a, self.spill_serving()).await? != ticket {
                self.wait(a, self.cfg.poll).await?;
            }
            return Ok(true);
        }
        let mut b = self.batch(a);
        let next = b.read(self.spill_next(), 8);
        let serving = b.read(self.spill_serving(), 8);
        let done = self.exec_live(b).await?;
        let (n, s) = (word_of(&done, next), word_of(&done, serving));
        if n != s {
            return Ok(false);
        }
        let mut b = self.batch(a);
        let id = b.cas(self.spill_next(), n, n + 1);
        Ok(self.exec_live(b).await?.value(id)? == n)
    }

    /// Acquires one node. The first node of a request may wait for holders (`blocking`); later
    /// ones only try, so a request never waits for others while holding part of its range.
    async fn acquire_piece(
        &self,
        a: &mut Acq,
        p: Piece,
        blocking: bool,
    ) -> Result<Outcome, LockError> {
        let n = p.node;
        let leaf = self.geo.is_leaf(n);
        let me = self.node(n);
        // (a) An internal node is taken through its bakery ticket.
        if !leaf && !self.take_ticket(a, me, blocking).await? {
            return Ok(Outcome::Busy);
        }
        let ancestors = self.geo.ancestors(n);
        let notify = self.geo.notify_set(n, self.cfg.m);
        let twait = self.cfg.twait();
        let mut failures = 0u32;
        loop {
            // (b)+(c) in one batch: read the ancestors, then lock this node.
            let start = self.clock.now();
            let mut b = self.batch(a);
            let reads: Vec<WrId> = ancestors.iter().map(|a| b.read(self.node(*a), 8)).collect();
            let lock = if leaf {
                b.masked_cas(me, 0, p.mask, p.mask, p.mask)
            } else {
                b.masked_faa(me, 1 << word::OCC_BIT, word::BOUNDARY)
            };
            let done = self.exec_live(b).await?;
            let locked_at = self.clock.now();
            let got = !leaf || done.value(lock)? & p.mask == 0;
            let blocker = ancestors
                .iter()
                .zip(&reads)
                .find(|(_, id)| word::occ(word_of(&done, **id)))
                .map(|(a, _)| *a);
            if let Some(anc) = blocker {
                // An ancestor is held: step back, wait for it, try again.
                if got || !blocking {
                    let h = Held {
                        piece: p,
                        notified: Vec::new(),
                    };
                    let mut b = Batch::new();
                    match (got, leaf) {
                        (true, _) => self.undo(&mut b, &h, !blocking),
                        (false, false) => self.pass_ticket(&mut b, me),
                        (false, true) => {}
                    }
                    if !b.is_empty() {
                        self.exec(b).await?;
                    }
                }
                if !blocking {
                    return Ok(Outcome::Busy);
                }
                while word::occ(self.read_word(a, self.node(anc)).await?) {
                    self.wait(a, self.cfg.poll).await?;
                }
                continue;
            }
            if !got {
                // Leaf bits held by someone else.
                if !blocking {
                    return Ok(Outcome::Busy);
                }
                failures += 1;
                if failures >= self.cfg.leaf_retries && n.level > 0 {
                    return Ok(Outcome::Escalate);
                }
                let d = self.jitter(self.cfg.poll * failures.min(16));
                self.wait(a, d).await?;
                continue;
            }
            // (d) Notify the ancestors; a notification later than Twait after the ancestor
            // check could be missed by a checker, so it aborts. A node with none to notify
            // (the root: a small file's whole tree) has no notification to be late.
            if !notify.is_empty() && self.notify(a, &notify, start, twait).await? {
                self.aborts.fetch_add(1, Ordering::Relaxed);
                // A blocking request keeps its ticket and retries the node; a trying one gives
                // the node up entirely.
                let h = Held {
                    piece: p,
                    notified: notify.clone(),
                };
                let mut b = Batch::new();
                self.undo(&mut b, &h, !blocking);
                self.exec(b).await?;
                if !blocking {
                    return Ok(Outcome::Busy);
                }
                let d = self.jitter(self.cfg.rtt_budget);
                self.wait(a, d).await?;
                continue;
            }
            if !leaf {
                // Every notifier that passed our Occ unseen has notified within Twait of
                // `locked_at`: wait that long, then for all of them to drain.
                let ready = locked_at + twait;
                let now = self.clock.now();
                if ready > now {
                    self.sleep(ready - now).await?;
                }
                self.wait_descendants(a, n).await?;
            }
            return Ok(Outcome::Got(Held {
                piece: p,
                notified: notify,
            }));
        }
    }

    /// Fast path for a request made only of leaves: read every ancestor and set every leaf's
    /// bits in one batch, notify in a second. Two round trips when nobody is in the way; on any
    /// conflict it undoes what it did and returns `None`, and the request takes the normal path.
    /// The Twait argument is the one of a single node: `start` precedes every ancestor read.
    async fn try_leaves_together(
        &self,
        a: &mut Acq,
        pieces: &[Piece],
    ) -> Result<Option<Vec<Held>>, LockError> {
        let start = self.clock.now();
        let mut ancestors: Vec<Node> = pieces
            .iter()
            .flat_map(|p| self.geo.ancestors(p.node))
            .collect();
        ancestors.sort();
        ancestors.dedup();
        let mut b = self.batch(a);
        let reads: Vec<WrId> = ancestors.iter().map(|n| b.read(self.node(*n), 8)).collect();
        let cas: Vec<WrId> = pieces
            .iter()
            .map(|p| b.masked_cas(self.node(p.node), 0, p.mask, p.mask, p.mask))
            .collect();
        let done = self.exec_live(b).await?;
        let blocked = reads.iter().any(|id| word::occ(word_of(&done, *id)));
        let got: Vec<bool> = pieces
            .iter()
            .zip(&cas)
            .map(|(p, id)| done.value(*id).map(|old| old & p.mask == 0))
            .collect::<Result<_, _>>()?;
        let held: Vec<Held> = pieces
            .iter()
            .map(|p| Held {
                piece: *p,
                notified: self.geo.notify_set(p.node, self.cfg.m),
            })
            .collect();
        if blocked || got.contains(&false) {
            let mut b = Batch::new();
            for (h, ok) in held.iter().zip(&got) {
                if *ok {
                    self.undo(
                        &mut b,
                        &Held {
                            piece: h.piece,
                            notified: Vec::new(),
                        },
                        true,
                    );
                }
            }
            if !b.is_empty() {
                self.exec(b).await?;
            }
            return Ok(None);
        }
        let mut b = self.batch(a);
        for h in &held {
            for n in &h.notified {
                b.masked_faa(self.node(*n), 1 << word::DMAX_SHIFT, word::BOUNDARY);
            }
        }
        self.exec_live(b).await?;
        if self.clock.now() - start > self.cfg.twait() {
            self.aborts.fetch_add(1, Ordering::Relaxed);
            self.release_held(&held).await?;
            return Ok(None);
        }
        Ok(Some(held))
    }

    /// Takes a ticket on an internal node; without `blocking`, only if nobody holds or waits.
    async fn take_ticket(
        &self,
        a: &mut Acq,
        me: RemoteAddr,
        blocking: bool,
    ) -> Result<bool, LockError> {
        if blocking {
            let mut b = self.batch(a);
            let id = b.masked_faa(me, 1 << word::TMAX_SHIFT, word::BOUNDARY);
            let old = self.exec_live(b).await?.value(id)?;
            let ticket = word::tmax(old);
            let mut w = old;
            while word::tcnt(w) != ticket {
                self.wait(a, self.cfg.poll).await?;
                w = self.read_word(a, me).await?;
            }
            return Ok(true);
        }
        let w = self.read_word(a, me).await?;
        if word::tcnt(w) != word::tmax(w) {
            return Ok(false);
        }
        let bumped = rackfs_verbs::masked::masked_faa(w, 1 << word::TMAX_SHIFT, word::BOUNDARY);
        let mut b = self.batch(a);
        let id = b.masked_cas(me, w, word::T_MASK, bumped, word::TMAX_MASK);
        let old = self.exec_live(b).await?.value(id)?;
        Ok(old & word::T_MASK == w & word::T_MASK)
    }

    /// Gives up a ticket (adds 1 to `TCnt`).
    fn pass_ticket(&self, b: &mut Batch<'_>, me: RemoteAddr) {
        b.masked_faa(me, 1 << word::TCNT_SHIFT, word::BOUNDARY);
    }

    /// Appends the ops that undo a held node: clear its leaf bits or toggle `Occ` off (and
    /// with `pass_ticket`, give up the node's ticket in the same add), and add 1 to the `DCnt`
    /// of every ancestor it notified.
    fn undo(&self, b: &mut Batch<'_>, h: &Held, pass_ticket: bool) {
        let me = self.node(h.piece.node);
        if self.geo.is_leaf(h.piece.node) {
            b.masked_cas(me, 0, 0, 0, h.piece.mask);
        } else {
            let ticket = if pass_ticket {
                1 << word::TCNT_SHIFT
            } else {
                0
            };
            b.masked_faa(me, 1 << word::OCC_BIT | ticket, word::BOUNDARY);
        }
        for n in &h.notified {
            b.masked_faa(self.node(*n), 1 << word::DCNT_SHIFT, word::BOUNDARY);
        }
    }

    /// Waits until no notified descendant request remains: this node's own `DCnt == DMax`, and
    /// the same on every internal node of the `m` levels below it (which include a beacon level).
    async fn wait_descendants(&self, a: &mut Acq, n: Node) -> Result<(), LockError> {
        let window = self.geo.check_window(n, self.cfg.m);
        loop {
            let mut b = self.batch(a);
            let own = b.read(self.node(n), 8);
            let levels: Vec<(WrId, u64)> = window
                .iter()
                .map(|&(level, first, count)| {
                    (
                        b.read(
                            self.node(Node {
                                level,
                                index: first,
                            }),
                            (count * 8) as u32,
                        ),
                        count,
                    )
                })
                .collect();
            let done = self.exec_live(b).await?;
            let mut drained = word::drained(word_of(&done, own));
            for (id, count) in levels {
                let d = done.data(id)?;
                drained &= (0..count as usize).all(|i| {
                    word::drained(u64::from_le_bytes(
                        d[i * 8..i * 8 + 8].try_into().expect("8"),
                    ))
                });
            }
            if drained {
                return Ok(());
            }
            self.wait(a, self.cfg.poll).await?;
        }
    }

    /// Releases held nodes in one batch (tickets passed).
    async fn release_held(&self, held: &[Held]) -> Result<(), VerbsError> {
        if held.is_empty() {
            return Ok(());
        }
        let mut b = Batch::new();
        for h in held {
            self.undo(&mut b, h, true);
        }
        self.exec(b).await.map(|_| ())
    }

    /// Releases a range: one batch, the spillover mutex's pass and the slot included (a range
    /// lent from a kept tree goes back to it, with no remote operation).
    pub async fn release(&self, g: RangeGuard) -> Result<(), LockError> {
        if g.lent {
            self.give_back(g);
            return Ok(());
        }
        self.release_exact(g).await
    }

    pub(crate) async fn release_exact(&self, g: RangeGuard) -> Result<(), LockError> {
        let mut b = Batch::new();
        if g.signalled {
            b.faa(self.waiting(), u64::MAX);
        }
        for h in &g.held {
            self.undo(&mut b, h, true);
        }
        if g.spill {
            b.faa(self.spill_serving(), 1);
        }
        b.faa(self.slot(), u64::MAX);
        self.exec(b).await?;
        Ok(())
    }
}

fn word_of(done: &Completions, id: WrId) -> u64 {
    u64::from_le_bytes(
        done.data(id)
            .expect("checked batch")
            .try_into()
            .expect("8 bytes"),
    )
}
