//! The `sim` transport: a deterministic, single-threaded simulation with virtual time.
//!
//! A [`Sim`] owns simulated memory (one read-write region, [`SIM_RKEY`], and a small read-only
//! one, [`SIM_RO_RKEY`]), a seeded random source, an event queue ordered by (virtual time,
//! sequence number), and the tasks of simulated clients. Every work request is delayed by a
//! random amount before it executes; requests of one queue pair execute in posting order, those
//! of different queue pairs interleave freely; completions return after another random delay,
//! in order per queue pair. Nothing depends on the host's clock or thread scheduling, so a seed
//! replays exactly.
//!
//! Clients can be *paused* (their tasks are not polled for a while: a descheduled or stalled
//! process) and *killed* (their tasks are dropped and their connection torn down: requests
//! already executed stay executed, the ones not yet executed are discarded).

use std::cell::Cell;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use slab::Slab;

use crate::qp::{Posted, QueuePair, Slot, Transport};
use crate::region::{Region, RegionInfo, RegionTable};
use crate::wr::{Access, Batch, Completions, Outcome, WorkRequest};
use crate::VerbsError;

/// Key of the simulated read-write region.
pub const SIM_RKEY: u32 = 0x5153_0001;
/// Key of the simulated read-only region (4 KiB).
pub const SIM_RO_RKEY: u32 = 0x5153_0002;

/// Knobs of a simulation run.
#[derive(Clone, Debug)]
pub struct SimConfig {
    pub seed: u64,
    /// Bytes of the read-write region.
    pub region_len: u64,
    /// Delay before a batch's first request executes, and before a completion returns: uniform
    /// in `[min_delay, max_delay]`, except with probability `tail_ppm` per million it is
    /// uniform up to `tail_delay` (a congested or stalled network).
    pub min_delay: Duration,
    pub max_delay: Duration,
    pub tail_ppm: u32,
    pub tail_delay: Duration,
    /// Gap between consecutive requests of one batch: uniform in `[0, intra_batch_delay]`.
    pub intra_batch_delay: Duration,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            seed: 0,
            region_len: 1 << 20,
            min_delay: Duration::from_nanos(500),
            max_delay: Duration::from_micros(3),
            tail_ppm: 1000,
            tail_delay: Duration::from_micros(100),
            intra_batch_delay: Duration::from_nanos(500),
        }
    }
}

/// A simulated client process (owner of tasks and queue pairs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ClientId(pub usize);

/// How [`Sim::run`] stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RunOutcome {
    /// Every task finished.
    Finished,
    /// Virtual time reached the limit with tasks still running.
    TimeLimit,
    /// Tasks remain but nothing can ever wake them: a liveness failure.
    Stalled,
}

/// SplitMix64: tiny, fast and good enough to drive schedules.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            ((self.next() as u128 * n as u128) >> 64) as u64
        }
    }
    fn between(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi.saturating_sub(lo) + 1)
    }
}

enum EventKind {
    /// Execute the next request of the batch at the head of a queue pair.
    Exec { qp: usize },
    /// Deliver a batch's completions.
    Complete { batch: usize },
    /// Wake a task (timer expiry, end of a pause).
    Wake(Waker),
}

struct Event {
    time: u64,
    seq: u64,
    kind: EventKind,
}

impl PartialEq for Event {
    fn eq(&self, o: &Self) -> bool {
        (self.time, self.seq) == (o.time, o.seq)
    }
}
impl Eq for Event {}
impl PartialOrd for Event {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Event {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (self.time, self.seq).cmp(&(o.time, o.seq))
    }
}

struct InFlightBatch {
    requests: Vec<WorkRequest<'static>>,
    next: usize,
    failed: bool,
    done: Completions,
    slot: Arc<Slot>,
}

struct QpState {
    client: ClientId,
    /// Batches posted and not yet fully executed, in order; the head one is executing.
    queue: VecDeque<usize>,
    last_completion: u64,
}

#[derive(Default)]
struct ClientState {
    killed: bool,
    paused_until: u64,
}

struct World {
    now: u64,
    seq: u64,
    rng: Rng,
    cfg: SimConfig,
    events: BinaryHeap<Reverse<Event>>,
    table: RegionTable,
    qps: Vec<QpState>,
    clients: Vec<ClientState>,
    batches: Slab<InFlightBatch>,
    executed: u64,
}

impl World {
    fn schedule(&mut self, time: u64, kind: EventKind) {
        self.seq += 1;
        self.events.push(Reverse(Event {
            time,
            seq: self.seq,
            kind,
        }));
    }

    fn network_delay(&mut self) -> u64 {
        let c = &self.cfg;
        let (lo, hi) = (c.min_delay.as_nanos() as u64, c.max_delay.as_nanos() as u64);
        let tail = c.tail_delay.as_nanos() as u64;
        if self.rng.below(1_000_000) < c.tail_ppm as u64 {
            self.rng.between(lo, tail.max(lo))
        } else {
            self.rng.between(lo, hi)
        }
    }

    fn exec_next(&mut self, qp: usize) {
        let Some(&b) = self.qps[qp].queue.front() else {
            return;
        };
        let batch = &mut self.batches[b];
        if batch.next < batch.requests.len() {
            let i = batch.next;
            batch.next += 1;
            if batch.failed {
                batch.done.push(Outcome::Failed(VerbsError::Flushed));
            } else {
                let wr = &batch.requests[i];
                let result = match self.table.get(wr.addr().rkey) {
                    Some(r) => r.execute(wr, &mut batch.done),
                    None => Err(VerbsError::BadKey {
                        rkey: wr.addr().rkey,
                    }),
                };
                self.executed += 1;
                if let Err(e) = result {
                    batch.done.push(Outcome::Failed(e));
                    batch.failed = true;
                }
            }
        }
        if batch.next < batch.requests.len() {
            let gap = self
                .rng
                .below(self.cfg.intra_batch_delay.as_nanos() as u64 + 1);
            self.schedule(self.now + gap, EventKind::Exec { qp });
            return;
        }
        // The head batch is fully executed: return its completions, start the next batch.
        self.qps[qp].queue.pop_front();
        let back = self.network_delay();
        let at = (self.now + back).max(self.qps[qp].last_completion);
        self.qps[qp].last_completion = at;
        self.schedule(at, EventKind::Complete { batch: b });
        if !self.qps[qp].queue.is_empty() {
            let d = self.network_delay();
            self.schedule(self.now + d, EventKind::Exec { qp });
        }
    }
}

/// A cheap, cloneable handle on the simulated world, usable from inside tasks.
#[derive(Clone)]
pub struct SimHandle(Arc<Mutex<World>>);

impl SimHandle {
    fn world(&self) -> MutexGuard<'_, World> {
        self.0.lock().expect("sim world lock")
    }

    /// Virtual time since the simulation started.
    pub fn now(&self) -> Duration {
        Duration::from_nanos(self.world().now)
    }

    /// A future that completes after `d` of virtual time.
    pub fn clock_sleep(&self, d: Duration) -> crate::Sleep {
        crate::Clock::Sim(self.clone()).sleep(d)
    }

    /// A deterministic random number (the run's single random source).
    pub fn random(&self) -> u64 {
        self.world().rng.next()
    }

    /// A deterministic random number in `0..n`.
    pub fn random_below(&self, n: u64) -> u64 {
        self.world().rng.below(n)
    }

    pub(crate) fn wake_at(&self, at: Duration, waker: Waker) {
        self.world()
            .schedule(at.as_nanos() as u64, EventKind::Wake(waker));
    }

    /// Opens a new queue pair for `client`.
    pub fn connect(&self, client: ClientId) -> QueuePair {
        let mut w = self.world();
        w.qps.push(QpState {
            client,
            queue: VecDeque::new(),
            last_completion: 0,
        });
        let qp = w.qps.len() - 1;
        let infos = w.table.infos();
        QueuePair(Arc::new(Transport::Sim(SimQp {
            handle: self.clone(),
            qp,
            infos,
        })))
    }

    /// Kills a client: its tasks are dropped before they run again and its requests not yet
    /// executed are discarded (the node tears its connections down).
    pub fn kill(&self, client: ClientId) {
        let mut w = self.world();
        w.clients[client.0].killed = true;
        let World { qps, batches, .. } = &mut *w;
        for q in qps.iter_mut().filter(|q| q.client == client) {
            for b in q.queue.drain(..) {
                let batch = batches.remove(b);
                batch.slot.complete(Err(VerbsError::Killed));
            }
        }
    }

    pub fn is_killed(&self, client: ClientId) -> bool {
        self.world().clients[client.0].killed
    }

    /// Stops polling a client's tasks for `d` of virtual time (its posted requests still run).
    pub fn pause(&self, client: ClientId, d: Duration) {
        let mut w = self.world();
        let until = w.now + d.as_nanos() as u64;
        let c = &mut w.clients[client.0];
        c.paused_until = c.paused_until.max(until);
    }

    /// The simulated read-write region, for oracles that inspect memory directly.
    pub fn region(&self) -> Arc<Region> {
        self.world()
            .table
            .get(SIM_RKEY)
            .expect("sim region")
            .clone()
    }

    /// Work requests executed so far.
    pub fn verbs_executed(&self) -> u64 {
        self.world().executed
    }
}

pub(crate) struct SimQp {
    handle: SimHandle,
    qp: usize,
    infos: Vec<RegionInfo>,
}

impl SimQp {
    pub(crate) fn handle(&self) -> SimHandle {
        self.handle.clone()
    }

    pub(crate) fn regions(&self) -> &[RegionInfo] {
        &self.infos
    }

    pub(crate) fn post(&self, batch: Batch<'_>) -> Posted {
        let mut w = self.handle.world();
        let client = w.qps[self.qp].client;
        if w.clients[client.0].killed {
            return Posted::ready(Err(VerbsError::Killed));
        }
        let slot = Arc::new(Slot::default());
        let n = batch.len();
        let read_bytes = batch.read_bytes() as usize;
        let b = w.batches.insert(InFlightBatch {
            requests: batch
                .requests
                .into_iter()
                .map(WorkRequest::into_owned)
                .collect(),
            next: 0,
            failed: false,
            done: Completions::with_capacity(n, read_bytes),
            slot: slot.clone(),
        });
        w.qps[self.qp].queue.push_back(b);
        if w.qps[self.qp].queue.len() == 1 {
            let d = w.network_delay();
            let now = w.now;
            w.schedule(now + d, EventKind::Exec { qp: self.qp });
        }
        Posted::sim(slot)
    }
}

struct TaskWaker {
    id: usize,
    queued: AtomicBool,
    ready: Arc<Mutex<VecDeque<usize>>>,
}

impl Wake for TaskWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        if !self.queued.swap(true, Ordering::AcqRel) {
            self.ready.lock().expect("ready queue").push_back(self.id);
        }
    }
}

struct Task {
    client: ClientId,
    fut: Pin<Box<dyn Future<Output = ()>>>,
    waker: Arc<TaskWaker>,
}

/// The simulation: world plus executor.
pub struct Sim {
    handle: SimHandle,
    tasks: Vec<Option<Task>>,
    live: usize,
    ready: Arc<Mutex<VecDeque<usize>>>,
}

thread_local! {
    static IN_SIM: Cell<bool> = const { Cell::new(false) };
}

impl Sim {
    pub fn new(cfg: SimConfig) -> Sim {
        let table = RegionTable::new(vec![
            Arc::new(Region::heap(cfg.region_len, SIM_RKEY, Access::ALL)),
            Arc::new(Region::heap(4096, SIM_RO_RKEY, Access::READ)),
        ]);
        let world = World {
            now: 0,
            seq: 0,
            rng: Rng(cfg.seed ^ 0x005E_ED0F_5111),
            cfg,
            events: BinaryHeap::new(),
            table,
            qps: Vec::new(),
            clients: Vec::new(),
            batches: Slab::new(),
            executed: 0,
        };
        Sim {
            handle: SimHandle(Arc::new(Mutex::new(world))),
            tasks: Vec::new(),
            live: 0,
            ready: Arc::default(),
        }
    }

    pub fn handle(&self) -> SimHandle {
        self.handle.clone()
    }

    pub fn add_client(&mut self) -> ClientId {
        let mut w = self.handle.world();
        w.clients.push(ClientState::default());
        ClientId(w.clients.len() - 1)
    }

    /// Runs `fut` as a task of `client`.
    pub fn spawn(&mut self, client: ClientId, fut: impl Future<Output = ()> + 'static) {
        let id = self.tasks.len();
        let waker = Arc::new(TaskWaker {
            id,
            queued: AtomicBool::new(true),
            ready: self.ready.clone(),
        });
        self.tasks.push(Some(Task {
            client,
            fut: Box::pin(fut),
            waker,
        }));
        self.live += 1;
        self.ready.lock().expect("ready queue").push_back(id);
    }

    /// Runs until every task has finished, virtual time passes `limit`, or nothing can progress.
    pub fn run(&mut self, limit: Duration) -> RunOutcome {
        let limit = limit.as_nanos() as u64;
        assert!(
            !IN_SIM.with(|f| f.replace(true)),
            "Sim::run is not reentrant"
        );
        let outcome = self.run_inner(limit);
        IN_SIM.with(|f| f.set(false));
        outcome
    }

    fn run_inner(&mut self, limit: u64) -> RunOutcome {
        loop {
            loop {
                let next = self.ready.lock().expect("ready queue").pop_front();
                let Some(id) = next else { break };
                self.poll_task(id);
            }
            if self.live == 0 {
                return RunOutcome::Finished;
            }
            let mut w = self.handle.world();
            let Some(Reverse(ev)) = w.events.pop() else {
                return RunOutcome::Stalled;
            };
            if ev.time > limit {
                w.events.push(Reverse(ev));
                return RunOutcome::TimeLimit;
            }
            w.now = w.now.max(ev.time);
            match ev.kind {
                EventKind::Exec { qp } => w.exec_next(qp),
                EventKind::Complete { batch } => {
                    let b = w.batches.remove(batch);
                    drop(w);
                    b.slot.complete(Ok(b.done));
                }
                EventKind::Wake(waker) => {
                    drop(w);
                    waker.wake();
                }
            }
        }
    }

    fn poll_task(&mut self, id: usize) {
        let Some(task) = self.tasks[id].as_mut() else {
            return;
        };
        task.waker.queued.store(false, Ordering::Release);
        let (killed, paused_until, now) = {
            let w = self.handle.world();
            let c = &w.clients[task.client.0];
            (c.killed, c.paused_until, w.now)
        };
        if killed {
            self.tasks[id] = None;
            self.live -= 1;
            return;
        }
        if paused_until > now {
            let waker = Waker::from(task.waker.clone());
            self.handle
                .world()
                .schedule(paused_until, EventKind::Wake(waker));
            return;
        }
        let waker = Waker::from(task.waker.clone());
        let mut cx = Context::from_waker(&waker);
        if let Poll::Ready(()) = task.fut.as_mut().poll(&mut cx) {
            self.tasks[id] = None;
            self.live -= 1;
        }
    }
}
