//! A mount's QoS engine for one memory node (Haechi §II-D): a token check before each
//! one-sided data operation, reservation tokens first, then global tokens claimed from the
//! node's pool with one remote FAA per batch, the prorated decay of unused reservation, silent
//! reports (one 8-byte WRITE) while the monitor asks for them, and limits.
//!
//! The engine refreshes its view of the node (period, pool, grant) at most every δ (1 ms), in
//! one batch, from whichever request comes by; an idle engine costs nothing. A request that
//! finds no token waits in line (FIFO): the first in line re-checks every δ, the others sleep
//! until it is served, and are woken at once then. Waiting never spins.
//!
//! A request larger than what one period allows (its limit share, or its reservation when the
//! pool is dry) is admitted piecewise: the first in line takes what the period has left and
//! waits for the rest in the following periods, so every request completes at the rate of its
//! limit (or reservation) whatever its size, and no period ever spends more than it had. While
//! a request waits, the engine reports its demand even when the monitor did not ask for
//! reports, so the primary's placement sees the node the mount is held back on.
//!
//! A mount's limit is one budget over its engines: the primary splits it over the nodes by
//! demand, and a request held back by its node's share borrows room the mount's engine on
//! another node has left this period ([`QosEngine::admit_borrowing`], [`QosEngine::lend_room`]):
//! the lender counts it as spent, the borrower as its own, and a new period clears both, so
//! the mount spends its limit wherever it works and never more over any run of periods.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use rackfs_verbs::{Batch, Clock, QueuePair, RemoteAddr, VerbsError};

use crate::area::{self, pack_pair, pool_take, unpack_pool, POOL_BOUNDARY};

#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Global tokens claimed per FAA.
    pub batch: u64,
    /// Refresh, decay and report interval.
    pub delta: Duration,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            batch: 64,
            delta: Duration::from_millis(1),
        }
    }
}

/// How long a request may wait without gathering a single token (at least: ten of the
/// node's periods if they are longer) before the node's QoS is taken for gone: a monitor that
/// stopped (a dead node whose memory a shm client still maps reads as frozen) or one that
/// does not serve this mount's slot (a node started again). The wait ends with an error, so
/// nothing waits forever; the mount then treats the node as failed.
pub const STALL: Duration = Duration::from_secs(10);

#[derive(Default, Debug, Clone, Copy)]
struct State {
    period: u64,
    grant: u64,
    limit: u64,
    /// Reservation tokens left.
    reservation: u64,
    /// Global tokens claimed and not used.
    global: u64,
    /// Tokens used this period, and of them from the pool.
    used: u64,
    from_pool: u64,
    /// Tokens asked for this period (demand).
    asked: u64,
    claimed: u64,
    /// The node's pool was empty at the last claim or refresh.
    pool_empty: bool,
    reporting: bool,
    period_us: u64,
    refreshed_at: Option<Duration>,
    /// Tokens spent since the last refresh.
    spent_since_refresh: u64,
    /// The node's time into the period at the last refresh.
    last_elapsed_us: Option<u64>,
    /// Limit room this period lent to the mount's engine on another node, and borrowed from
    /// one ([`QosEngine::lend_room`]): the mount's limit is one budget over its nodes.
    lent: u64,
    borrowed: u64,
}

impl State {
    /// Tokens the limit still allows this period (`u64::MAX`: no limit).
    fn room(&self) -> u64 {
        if self.limit > 0 {
            (self.limit + self.borrowed).saturating_sub(self.used + self.lent)
        } else {
            u64::MAX
        }
    }
}

/// Everything a token check touches, under one lock: the period's state, the totals and the
/// line of waiting requests.
#[derive(Default)]
struct Inner {
    s: State,
    totals: EngineTotals,
    line: Line,
    /// Checks made by [`QosEngine::try_admit`] (it reads the clock every eighth).
    quick_checks: u64,
    /// Tokens requests waiting in line still need: a new period counts them as asked for, so
    /// a request spanning periods shows its demand in each.
    owed: u64,
}

/// What one engine did in one finished period.
#[derive(Default, Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeriodUse {
    pub period: u64,
    pub grant: u64,
    /// Tokens spent, and of them from the pool.
    pub used: u64,
    pub from_pool: u64,
    /// Tokens taken from the pool (spent or lapsed at the period's end).
    pub claimed: u64,
    /// Tokens asked for.
    pub asked: u64,
}

/// Counters for visibility (all periods).
#[derive(Default, Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineTotals {
    pub from_reservation: u64,
    pub from_pool: u64,
    pub claims: u64,
    pub waits: u64,
}

pub struct QosEngine {
    qp: QueuePair,
    clock: Clock,
    area: RemoteAddr,
    slot: u16,
    cfg: EngineConfig,
    inner: Mutex<Inner>,
    flight: Arc<Flight>,
    finished: Mutex<Vec<PeriodUse>>,
}

/// Operations admitted and not yet done; whether none was, at some moment since the last
/// refresh (the mount was not backlogged then).
#[derive(Default)]
struct Flight {
    count: AtomicU64,
    idle_seen: AtomicBool,
}

/// An admitted operation: drop it when the operation is done (its tokens stay spent).
#[must_use = "hold it until the operation completes"]
pub struct InFlight {
    flight: Arc<Flight>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if self.flight.count.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.flight.idle_seen.store(true, Ordering::SeqCst);
        }
    }
}

/// Requests waiting for tokens, first come first served.
#[derive(Default)]
struct Line {
    next: u64,
    serving: u64,
    wakers: Vec<Waker>,
}

impl Line {
    fn waiting(&self) -> bool {
        self.next != self.serving
    }
    fn join(&mut self) -> u64 {
        self.next += 1;
        self.next - 1
    }
    /// The first in line is done: wake the others to see whose turn it is.
    fn leave(&mut self) {
        self.serving += 1;
        for w in self.wakers.drain(..) {
            w.wake();
        }
    }
}

/// Resolves when `ticket` is first in line.
struct Turn<'a> {
    inner: &'a Mutex<Inner>,
    ticket: u64,
}

impl Future for Turn<'_> {
    type Output = ();
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let mut inner = self.inner.lock().expect("QoS engine state");
        if inner.line.serving == self.ticket {
            Poll::Ready(())
        } else {
            inner.line.wakers.push(cx.waker().clone());
            Poll::Pending
        }
    }
}

enum Step {
    Go,
    Claim,
    Wait,
}

impl QosEngine {
    pub fn new(qp: QueuePair, area: RemoteAddr, slot: u16, cfg: EngineConfig) -> QosEngine {
        let clock = qp.clock();
        QosEngine {
            qp,
            clock,
            area,
            slot,
            cfg,
            inner: Mutex::new(Inner::default()),
            flight: Arc::new(Flight::default()),
            finished: Mutex::new(Vec::new()),
        }
    }

    pub fn totals(&self) -> EngineTotals {
        self.lock().totals
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().expect("QoS engine state")
    }

    /// The period this engine is in, and the tokens it used in it.
    pub fn current(&self) -> (u64, u64) {
        let s = &self.lock().s;
        (s.period, s.used)
    }

    /// Takes the records of the periods finished since the last call (at most 256 are kept).
    pub fn take_finished(&self) -> Vec<PeriodUse> {
        std::mem::take(&mut *self.finished.lock().expect("finished"))
    }

    fn slot_addr(&self, off: u64) -> RemoteAddr {
        self.area.add(area::slot(self.slot) + off)
    }

    /// Reads the node's period, pool and this mount's grant; starts a new period, decays the
    /// reservation, and writes a report if asked. One round trip.
    async fn refresh(&self) -> Result<(), VerbsError> {
        let report = {
            let inner = self.lock();
            let s = &inner.s;
            (s.reporting || inner.line.waiting()).then(|| {
                (
                    pack_pair(s.period, s.reservation, s.used - s.from_pool),
                    pack_pair(s.period, s.asked, s.used),
                )
            })
        };
        let mut b = Batch::new();
        if let Some((report, usage)) = report {
            b.write_u64(self.slot_addr(area::REPORT_WORD), report);
            b.write_u64(self.slot_addr(area::USAGE), usage);
        }
        let head = b.read(self.area, 48);
        let slot = b.read(self.slot_addr(0), 48);
        // The view is as old as the moment it was asked for (this task may be descheduled
        // before it sees the answer).
        let asked_at = self.clock.now();
        let done = self.qp.post(b).await?;
        done.check()?;
        let h = done.data(head)?;
        let w = |d: &[u8], i: usize| u64::from_le_bytes(d[i * 8..i * 8 + 8].try_into().expect("8"));
        let (period, reporting, elapsed_us, period_us) = (w(h, 0), w(h, 2) != 0, w(h, 3), w(h, 4));
        let sl = done.data(slot)?;
        let mut inner = self.lock();
        let waiting = inner.line.waiting();
        let owed = inner.owed;
        let s = &mut inner.s;
        if period != s.period {
            // A new period: the grant replaces whatever was left; unused global tokens lapse.
            if s.period != 0 {
                let mut f = self.finished.lock().expect("finished");
                if f.len() >= 256 {
                    f.remove(0);
                }
                f.push(PeriodUse {
                    period: s.period,
                    grant: s.grant,
                    used: s.used,
                    from_pool: s.from_pool,
                    claimed: s.claimed,
                    asked: s.asked,
                });
            }
            *s = State {
                period,
                grant: w(sl, 0),
                limit: w(sl, 1),
                reservation: w(sl, 0),
                period_us,
                asked: owed,
                ..State::default()
            };
        }
        // Decay for lack of demand (Haechi's prorated decay, applied to intervals in which
        // the mount was not backlogged): over an interval in which it had, at some moment, no
        // operation in flight and none waiting, a mount forfeits what it fell short of its
        // prorated reservation (grant * interval / period - spent). A mount that kept
        // operations outstanding all along forfeits nothing, however slowly the node served
        // it: its demand was there, the node was busy.
        let idle = self.flight.idle_seen.swap(false, Ordering::SeqCst)
            || (self.flight.count.load(Ordering::SeqCst) == 0 && !waiting);
        if let Some(last) = s.last_elapsed_us {
            let interval = elapsed_us.saturating_sub(last);
            if idle && s.period_us > 0 {
                let due = (s.grant as u128 * interval as u128 / s.period_us as u128) as u64;
                let lost = due.saturating_sub(s.spent_since_refresh);
                s.reservation = s.reservation.saturating_sub(lost);
            }
        }
        s.last_elapsed_us = Some(elapsed_us);
        s.spent_since_refresh = 0;
        // This mount's share of the global pool. Negative: a claim already told the monitor
        // this mount wants global tokens, and none came yet. Zero: nothing asked yet; the next
        // claim both tries and asks.
        let (tag, share) = unpack_pool(w(sl, 4));
        s.pool_empty = tag != s.period & 0xffff || share < 0;
        s.reporting = reporting;
        s.refreshed_at = Some(asked_at);
        Ok(())
    }

    async fn refresh_if_due(&self) -> Result<(), VerbsError> {
        let due = self.due(&self.lock().s);
        if due {
            self.refresh().await?;
        }
        Ok(())
    }

    /// Keeps the engine's view fresh while it is idle (call every δ from a background task):
    /// an idle mount's reservation decays and its reports say so, so the monitor can give it
    /// to others.
    pub async fn tick(&self) -> Result<(), VerbsError> {
        self.refresh_if_due().await
    }

    /// Waits until `tokens` may be spent on one-sided data operations on this node; hold the
    /// returned [`InFlight`] until they are done.
    pub async fn admit(&self, tokens: u64) -> Result<InFlight, VerbsError> {
        self.admit_borrowing(tokens, &|_| false).await
    }

    /// [`QosEngine::admit`], where a request held back by this node's limit share first asks
    /// `borrow` for that much limit room from the mount's engines on other nodes (each time it
    /// would wait): `borrow(t)` is true when another engine lent `t` ([`QosEngine::lend_room`]).
    pub async fn admit_borrowing(
        &self,
        tokens: u64,
        borrow: &dyn Fn(u64) -> bool,
    ) -> Result<InFlight, VerbsError> {
        self.admit_tokens(tokens, borrow).await?;
        self.flight.count.fetch_add(1, Ordering::SeqCst);
        Ok(InFlight {
            flight: self.flight.clone(),
        })
    }

    /// Admits `tokens` at once if this engine holds them and its view of the node is fresh:
    /// the common case, one lock and no await. `None`: call [`QosEngine::admit`].
    ///
    /// Reading the clock costs as much as the rest of the check, so this reads it every
    /// eighth call only: a busy engine's view is then at most eight operations staler than
    /// δ, and an idle one is kept fresh by [`QosEngine::tick`].
    pub fn try_admit(&self, tokens: u64) -> Option<InFlight> {
        let mut inner = self.lock();
        inner.quick_checks += 1;
        if (inner.quick_checks.is_multiple_of(8) || inner.s.refreshed_at.is_none())
            && self.due(&inner.s)
        {
            return None;
        }
        if inner.line.waiting() {
            return None;
        }
        match Self::take(&mut inner, tokens, false) {
            (_, Step::Go) => {
                inner.s.asked += tokens;
                drop(inner);
                self.flight.count.fetch_add(1, Ordering::SeqCst);
                Some(InFlight {
                    flight: self.flight.clone(),
                })
            }
            (_, Step::Claim | Step::Wait) => None,
        }
    }

    /// Whether `tokens` more would wait on this node now, as far as the engine's view goes:
    /// requests already wait in line, this period's limit share is spent, or the reservation
    /// and the pool are both dry. A reader with a replica on another node goes there instead,
    /// so a limit split over the nodes is reached whole (a stale view at a period's turn only
    /// sends a read elsewhere).
    pub fn would_wait(&self, tokens: u64) -> bool {
        let inner = self.lock();
        let s = &inner.s;
        let have = s.reservation + s.global;
        let short = s.room() < tokens || (have < tokens && s.pool_empty);
        // A view due for refresh may be of a period that ended: only a request tells.
        inner.line.waiting() || (short && !self.due(s))
    }

    /// Whether the view of the node is older than δ (the next request refreshes it).
    fn due(&self, s: &State) -> bool {
        s.refreshed_at
            .is_none_or(|t| self.clock.now() >= t + self.cfg.delta)
    }

    /// Whether this period's limit share leaves no room for `tokens` more: the mount may
    /// borrow room from its engine on another node ([`QosEngine::lend_room`]).
    pub fn short_of_room(&self, tokens: u64) -> bool {
        self.lock().s.room() < tokens
    }

    /// Gives up `tokens` of this period's limit room, for the same mount's engine on another
    /// node whose share is spent ([`QosEngine::add_room`]); `false` if this engine lacks the
    /// room, requests wait in line here, or its view of the node is older than 8δ (its
    /// period may have ended: room of an ended period is not lent). A limit split over the
    /// nodes by a guess of where the mount will work is thus reached whole wherever it works;
    /// the node's capacity is still guarded by its pool.
    pub fn lend_room(&self, tokens: u64) -> bool {
        let mut inner = self.lock();
        // The ticker refreshes an idle engine every 4δ.
        let fresh = inner
            .s
            .refreshed_at
            .is_some_and(|t| self.clock.now() < t + 8 * self.cfg.delta);
        if !fresh || inner.line.waiting() || inner.s.limit == 0 || inner.s.room() < tokens {
            return false;
        }
        inner.s.lent += tokens;
        true
    }

    /// Adds `tokens` of limit room lent by another engine of the mount to this period's
    /// (lost if the period has already ended: the lender gave up room the mount then does not
    /// use, never more).
    pub fn add_room(&self, tokens: u64) {
        let mut inner = self.lock();
        if inner.s.limit > 0 {
            inner.s.borrowed += tokens;
        }
    }

    async fn admit_tokens(
        &self,
        tokens: u64,
        borrow: &dyn Fn(u64) -> bool,
    ) -> Result<(), VerbsError> {
        let mut counted = false;
        // Fast path: nobody waiting and tokens at hand (or in the pool).
        loop {
            self.refresh_if_due().await?;
            let step = {
                let mut inner = self.lock();
                if !counted {
                    inner.s.asked += tokens;
                    counted = true;
                }
                if inner.line.waiting() {
                    (Step::Wait, false)
                } else {
                    let step = Self::take(&mut inner, tokens, false).1;
                    (step, inner.s.room() < tokens)
                }
            };
            match step {
                (Step::Go, _) => return Ok(()),
                (Step::Claim, _) => self.claim(tokens).await?,
                (Step::Wait, true) if borrow(tokens) => self.add_room(tokens),
                (Step::Wait, _) => break,
            }
        }
        // Wait in line: first come, first served, re-checking every δ.
        let ticket = {
            let mut inner = self.lock();
            inner.totals.waits += 1;
            inner.owed += tokens;
            inner.line.join()
        };
        let res = self.wait_in_line(ticket, tokens, borrow).await;
        self.lock().line.leave();
        res
    }

    /// Spends `tokens` if this engine has them, reservation first, then global, within the
    /// limit. With `partial`, spends what it has of them (the caller waits for the rest);
    /// without, all or nothing. Returns the tokens spent and what to do next.
    fn take(inner: &mut Inner, tokens: u64, partial: bool) -> (u64, Step) {
        let s = &mut inner.s;
        let room = s.room();
        let have = s.reservation + s.global;
        let n = tokens.min(room).min(have);
        if n == tokens || (partial && n > 0) {
            let from_res = s.reservation.min(n);
            s.reservation -= from_res;
            s.global -= n - from_res;
            s.used += n;
            s.spent_since_refresh += n;
            s.from_pool += n - from_res;
            let t = &mut inner.totals;
            t.from_reservation += from_res;
            t.from_pool += n - from_res;
        }
        let spent = if n == tokens || partial { n } else { 0 };
        let step = if n == tokens {
            Step::Go
        } else if room <= have || s.pool_empty {
            // Held back by the limit, or the pool has nothing more this period.
            Step::Wait
        } else {
            Step::Claim
        };
        (spent, step)
    }

    /// Takes a batch of global tokens from the node's pool (one remote FAA).
    async fn claim(&self, tokens: u64) -> Result<(), VerbsError> {
        let period = self.lock().s.period;
        // `tokens` is what the request still needs.
        let want = self.cfg.batch.max(tokens);
        let mut b = Batch::new();
        let id = b.masked_faa(self.slot_addr(area::SHARE), pool_take(want), POOL_BOUNDARY);
        let done = self.qp.post(b).await?;
        let (from, old) = unpack_pool(done.value(id)?);
        let got = old.clamp(0, want as i64) as u64;
        let mut inner = self.lock();
        inner.totals.claims += 1;
        let s = &mut inner.s;
        if s.period != period || from != period & 0xffff {
            // Tokens of another period than this engine's: they lapse (the engine refreshes
            // before it spends anything of a new period).
            s.pool_empty = false;
            s.refreshed_at = None;
            return Ok(());
        }
        s.global += got;
        s.claimed += got;
        if got < want {
            s.pool_empty = true;
        }
        Ok(())
    }

    /// Waits for `ticket`'s turn, then gathers `tokens`, piece by piece if one period does not
    /// have them all.
    async fn wait_in_line(
        &self,
        ticket: u64,
        tokens: u64,
        borrow: &dyn Fn(u64) -> bool,
    ) -> Result<(), VerbsError> {
        Turn {
            inner: &self.inner,
            ticket,
        }
        .await;
        let mut missing = tokens;
        let res = self.gather(&mut missing, borrow).await;
        if res.is_err() {
            // What a failed request still needed is no longer owed (what it got stays spent).
            self.lock().owed -= missing;
        }
        res
    }

    /// Gathers `missing` tokens. Fails once none came for [`STALL`] (or ten of the node's
    /// periods, if longer): the node's QoS monitor no longer serves this mount.
    async fn gather(
        &self,
        missing: &mut u64,
        borrow: &dyn Fn(u64) -> bool,
    ) -> Result<(), VerbsError> {
        let mut progress = (*missing, self.clock.now());
        loop {
            self.refresh_if_due().await?;
            let (step, period) = {
                let mut inner = self.lock();
                let (got, step) = Self::take(&mut inner, *missing, true);
                inner.owed -= got;
                *missing -= got;
                (step, Duration::from_micros(inner.s.period_us))
            };
            let short = *missing;
            if short < progress.0 {
                progress = (short, self.clock.now());
            }
            match step {
                Step::Go => return Ok(()),
                Step::Claim => self.claim(*missing).await?,
                Step::Wait if self.short_of_room(short) && borrow(short) => self.add_room(short),
                Step::Wait => {
                    let stalled = self.clock.now().saturating_sub(progress.1);
                    if stalled > STALL.max(period * 10) {
                        return Err(VerbsError::ConnectionLost {
                            peer: self.qp.peer().to_string(),
                            reason: format!(
                                "no QoS token came in {stalled:?}: the node's QoS monitor does not serve this mount (the node died or was started again)"
                            ),
                        });
                    }
                    self.clock.sleep(self.cfg.delta).await;
                    self.refresh().await?;
                }
            }
        }
    }
}
