//! A deterministic scheduler for code written with threads and blocking waits, so that whole
//! processes' production code (a memory node's roles, a mount's core) can run under
//! simulation without being rewritten as steps or futures.
//!
//! Every thread of a simulated world is an OS thread started by [`Turnstile::spawn`], but only
//! one of them runs at a time: the one holding the *turn*. A thread gives the turn back only
//! where the simulation can see it wait: a [`Clock::sleep`] on the turnstile's clock, a
//! [`Turnstile::yield_now`], a [`crate::Mutex`] another thread holds, a [`crate::Bell`] wait.
//! The thread giving it back then hands the turn straight to a thread chosen by a seeded
//! random source among those that can run (itself, if chosen again, runs on without a switch);
//! when none can, virtual time jumps to the earliest timer. The driver ([`Turnstile::run`])
//! only starts the world and waits for the reason it stops.
//! So a seed replays the same interleaving and the same virtual times, whatever the host's
//! scheduler does, and hours of leases and timeouts pass in milliseconds.
//!
//! Threads belong to *groups* (a process): [`Turnstile::kill`] makes every thread of a group
//! unwind at its next wait (its destructors run, as the memory it shared is dropped by its
//! owner), which is how a simulation kills a node or a mount.
//!
//! Invariants:
//! * at most one simulated thread runs between two waits; who runs next is chosen only while
//!   none does, under the world's lock;
//! * virtual time moves only when no thread can run, and only forward, to the earliest timer;
//! * a thread that holds the turn and blocks where the simulation cannot see it (a
//!   `std::sync::Mutex` another simulated thread holds, a socket) would stall the world: the
//!   driver reports it after [`Turnstile::set_watchdog`]'s real-time limit instead of hanging.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use crate::Clock;

/// Payload a killed thread unwinds with.
struct Killed;

/// How [`Turnstile::run`] stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Every thread finished (or was killed).
    Finished,
    /// Virtual time reached the limit with threads still alive.
    TimeLimit,
    /// Threads remain, none can run and no timer will wake one: a liveness failure.
    Stalled(Vec<String>),
    /// A thread panicked (other than by being killed): its name and message.
    Panicked(String),
    /// A thread held the turn past the watchdog without waiting where the simulation sees it.
    Stuck(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Run {
    Runnable,
    /// Waiting for a timer or a gate; `epoch` tells a stale timer from the current wait.
    Parked,
    Done,
}

struct Thread {
    name: String,
    group: u32,
    run: Run,
    /// Counts this thread's waits: a timer or a gate wakes only the wait it was set for.
    epoch: u64,
    killed: bool,
    /// Not given the turn before this virtual time (a stopped process).
    paused_until: Duration,
    /// Where this thread's OS thread waits for the turn (told alone when it gets it).
    wake: Arc<Condvar>,
}

#[derive(Default)]
struct State {
    now: Duration,
    rng: u64,
    running: Option<usize>,
    threads: Vec<Thread>,
    /// The threads not done, in the order they started: the ones each turn looks at.
    live: Vec<usize>,
    /// (deadline, sequence, thread, epoch)
    timers: BinaryHeap<Reverse<(Duration, u64, usize, u64)>>,
    seq: u64,
    /// Gate id -> (thread, epoch) waiting for it to open.
    gates: HashMap<u64, Vec<(usize, u64)>>,
    panicked: Option<String>,
    /// How far [`Turnstile::run`] goes this time, and how it stopped, once it did.
    until: Duration,
    outcome: Option<Outcome>,
    /// Turns handed out, and a fingerprint of who got them when.
    turns: u64,
    fingerprint: u64,
}

impl State {
    fn random(&mut self) -> u64 {
        // splitmix64
        self.rng = self.rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Until when group `group` is paused (the latest end of its live threads' pauses).
    fn paused_until(&self, group: u32) -> Duration {
        self.live_threads()
            .filter(|t| t.group == group)
            .map(|t| t.paused_until)
            .max()
            .unwrap_or_default()
    }

    /// Whether group `group` was killed (its newest thread was: a kill marks every one).
    fn killed(&self, group: u32) -> bool {
        self.threads
            .iter()
            .rev()
            .find(|t| t.group == group)
            .is_some_and(|t| t.killed)
    }

    fn live_threads(&self) -> impl Iterator<Item = &Thread> {
        self.live.iter().map(|&i| &self.threads[i])
    }

    fn wake(&mut self, tid: usize, epoch: u64) {
        let t = &mut self.threads[tid];
        if t.run == Run::Parked && t.epoch == epoch {
            t.run = Run::Runnable;
        }
    }

    /// Chooses who runs next, with no thread running: a runnable thread drawn from the seed
    /// (virtual time first moving to the earliest timer or end of a pause if none can run),
    /// or why the world stops.
    fn next(&mut self) -> Result<usize, Outcome> {
        loop {
            if let Some(p) = self.panicked.take() {
                return Err(Outcome::Panicked(p));
            }
            let now = self.now;
            let runnable: Vec<usize> = (self.live.iter().copied())
                .filter(|&i| {
                    self.threads[i].run == Run::Runnable && self.threads[i].paused_until <= now
                })
                .collect();
            if runnable.is_empty() {
                // The earliest end of a pause of a thread that could run, if it comes before
                // every timer: time moves there.
                let resume = self
                    .live_threads()
                    .filter(|t| t.run == Run::Runnable)
                    .map(|t| t.paused_until)
                    .min();
                let next_timer = self.timers.peek().map(|Reverse(t)| t.0);
                if let Some(r) = resume.filter(|&r| next_timer.is_none_or(|t| r <= t)) {
                    if r > self.until {
                        self.now = self.now.max(self.until);
                        return Err(Outcome::TimeLimit);
                    }
                    self.now = r;
                    continue;
                }
                let Some(Reverse((at, _, tid, epoch))) = self.timers.pop() else {
                    let waiting: Vec<String> = self
                        .live_threads()
                        .filter(|t| t.run == Run::Parked)
                        .map(|t| t.name.clone())
                        .collect();
                    return Err(if waiting.is_empty() {
                        Outcome::Finished
                    } else {
                        Outcome::Stalled(waiting)
                    });
                };
                let t = &self.threads[tid];
                if t.run != Run::Parked || t.epoch != epoch {
                    // A wait that ended otherwise (a gate, a kill): time does not move for it.
                    continue;
                }
                if at > self.until {
                    self.timers.push(Reverse((at, 0, tid, epoch)));
                    self.now = self.now.max(self.until);
                    return Err(Outcome::TimeLimit);
                }
                self.now = self.now.max(at);
                self.wake(tid, epoch);
                continue;
            }
            let pick = runnable[(self.random() % runnable.len() as u64) as usize];
            self.turns += 1;
            self.fingerprint = self
                .fingerprint
                .rotate_left(7)
                .wrapping_add(pick as u64 ^ self.now.as_nanos() as u64);
            self.running = Some(pick);
            return Ok(pick);
        }
    }
}

struct Shared {
    state: Mutex<State>,
    /// Where the driver waits for the running thread to give the turn back.
    driver: Condvar,
    wall_origin: u64,
    watchdog: Mutex<Duration>,
    /// The CPU every thread of this world runs on ([`world_cpu`]).
    cpu: Option<usize>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A poisoned lock means a simulated thread panicked while the driver recorded it;
        // the state is still consistent (every update is made whole under the lock).
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The running thread gave the turn back: hands it straight to the next thread (the same
    /// one, if chosen again, runs on with no switch), or tells the driver why the world
    /// stops. The driver takes no part in a turn: one switch per turn, not two.
    fn hand_on(&self, mut s: MutexGuard<'_, State>) {
        s.running = None;
        let wake = match s.next() {
            Ok(pick) => s.threads[pick].wake.clone(),
            Err(outcome) => {
                s.outcome = Some(outcome);
                drop(s);
                self.driver.notify_one();
                return;
            }
        };
        // Told once the lock is free: woken while it is held, that thread would run (all of a
        // world's threads share a CPU) only to wait for the lock.
        drop(s);
        wake.notify_one();
    }
}

thread_local! {
    /// The turnstile and thread id of the calling thread, if it is a simulated one.
    static CURRENT: std::cell::RefCell<Option<(Arc<Shared>, usize)>> = const { std::cell::RefCell::new(None) };
}

fn current() -> Option<(Arc<Shared>, usize)> {
    CURRENT.with(|c| c.borrow().clone())
}

/// A simulated world's scheduler and clock (see the module docs). Clones share the world.
#[derive(Clone)]
pub struct Turnstile {
    shared: Arc<Shared>,
}

impl Turnstile {
    /// An empty world at virtual time 0, its choices drawn from `seed`; its wall clock reads
    /// 2024-01-01T00:00:00Z at time 0.
    pub fn new(seed: u64) -> Turnstile {
        Turnstile {
            shared: Arc::new(Shared {
                state: Mutex::new(State {
                    rng: seed,
                    ..State::default()
                }),
                driver: Condvar::new(),
                wall_origin: 1_704_067_200_000_000_000,
                watchdog: Mutex::new(Duration::from_secs(20)),
                cpu: world_cpu(),
            }),
        }
    }

    /// How long (real time) a thread may hold the turn before [`Turnstile::run`] reports it
    /// as [`Outcome::Stuck`].
    pub fn set_watchdog(&self, d: Duration) {
        *self.shared.watchdog.lock().expect("watchdog") = d;
    }

    /// Starts `f` on a thread of group `group`, named `name`; it first runs when the driver
    /// gives it the turn (not while the group is paused; never if it was killed).
    pub fn spawn(&self, group: u32, name: &str, f: impl FnOnce() + Send + 'static) {
        let tid = {
            let mut s = self.shared.lock();
            // A new thread of a stopped process waits for it to resume; one of a killed
            // process unwinds when it would first run.
            let (paused_until, killed) = (s.paused_until(group), s.killed(group));
            s.threads.push(Thread {
                name: name.to_string(),
                group,
                run: Run::Runnable,
                epoch: 0,
                killed,
                paused_until,
                wake: Arc::new(Condvar::new()),
            });
            let tid = s.threads.len() - 1;
            s.live.push(tid);
            tid
        };
        let shared = self.shared.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("sim-{name}"))
            .spawn(move || {
                if let Some(cpu) = shared.cpu {
                    run_on(cpu);
                }
                CURRENT.with(|c| *c.borrow_mut() = Some((shared.clone(), tid)));
                let outcome = catch_unwind(AssertUnwindSafe(|| {
                    wait_turn(&shared, tid);
                    f();
                }));
                let mut s = shared.lock();
                s.threads[tid].run = Run::Done;
                s.live.retain(|&i| i != tid);
                if let Err(p) = outcome {
                    if !p.is::<Killed>() && s.panicked.is_none() {
                        let msg = p
                            .downcast_ref::<String>()
                            .cloned()
                            .or_else(|| p.downcast_ref::<&str>().map(|m| m.to_string()))
                            .unwrap_or_else(|| "(not a string)".into());
                        s.panicked = Some(format!("{}: {msg}", s.threads[tid].name));
                    }
                }
                shared.hand_on(s);
            });
        if let Err(e) = spawned {
            let mut s = self.shared.lock();
            s.threads[tid].run = Run::Done;
            s.live.retain(|&i| i != tid);
            s.panicked = Some(format!("{name}: no OS thread: {e}"));
        }
    }

    /// Starts threads in group `group` (a process of the world) for logic that takes a
    /// [`crate::Spawn`].
    pub fn threads(&self, group: u32) -> GroupThreads {
        GroupThreads {
            world: self.clone(),
            group,
        }
    }

    /// Kills group `group`: each of its threads unwinds at its next wait (at once if it is
    /// waiting now).
    pub fn kill(&self, group: u32) {
        let mut s = self.shared.lock();
        for t in s.threads.iter_mut().filter(|t| t.group == group) {
            t.killed = true;
            if t.run == Run::Parked {
                t.run = Run::Runnable;
            }
        }
        drop(s);
        if let Some((shared, me)) = current() {
            if Arc::ptr_eq(&shared, &self.shared) && shared.lock().threads[me].killed {
                resume_unwind(Box::new(Killed));
            }
        }
    }

    /// Pauses group `group` for `d` of virtual time from now: none of its threads gets the
    /// turn meanwhile (a stopped process); what it waits for may come and go.
    pub fn pause(&self, group: u32, d: Duration) {
        let mut s = self.shared.lock();
        let until = s.now + d;
        for t in s.threads.iter_mut().filter(|t| t.group == group) {
            t.paused_until = t.paused_until.max(until);
        }
        drop(s);
        // A thread pausing its own group stops here.
        Turnstile::yield_now();
    }

    /// Until when group `group` is paused (virtual time; at most now if it is not).
    pub fn paused_until(&self, group: u32) -> Duration {
        self.shared.lock().paused_until(group)
    }

    /// Whether group `group` was killed.
    pub fn killed(&self, group: u32) -> bool {
        self.shared.lock().killed(group)
    }

    /// Runs the world until every thread is done, or virtual time reaches `until`, or
    /// something went wrong (see [`Outcome`]). May be called again to go on.
    pub fn run(&self, until: Duration) -> Outcome {
        let watchdog = *self.shared.watchdog.lock().expect("watchdog");
        let mut s = self.shared.lock();
        s.until = until;
        s.outcome = None;
        match s.next() {
            Ok(pick) => s.threads[pick].wake.notify_one(),
            Err(outcome) => return outcome,
        }
        // The threads hand the turn on among themselves (`Shared::hand_on`) until one finds
        // the world must stop.
        loop {
            let turns = s.turns;
            let (next, timeout) = self
                .shared
                .driver
                .wait_timeout(s, watchdog)
                .unwrap_or_else(|p| p.into_inner());
            s = next;
            if let Some(outcome) = s.outcome.take() {
                return outcome;
            }
            if let (true, Some(running)) = (timeout.timed_out() && s.turns == turns, s.running) {
                let name = s.threads[running].name.clone();
                return Outcome::Stuck(format!(
                    "{name} held the turn for {watchdog:?} of real time without waiting \
                     where the simulation sees it (a std lock, a socket?)"
                ));
            }
        }
    }

    /// Virtual time now.
    pub fn now(&self) -> Duration {
        self.shared.lock().now
    }

    /// Turns handed out so far, and a fingerprint of who got them at what virtual time: two
    /// runs of one seed agree on both.
    pub fn schedule(&self) -> (u64, u64) {
        let s = self.shared.lock();
        (s.turns, s.fingerprint)
    }

    /// Whether the calling thread's process was killed: its thread is unwinding (destructors
    /// run, and may try to act), or will at its next wait. False off the simulation.
    pub fn killed_here() -> bool {
        Here::now().is_some_and(|h| h.killed())
    }

    /// The group (process) of the calling thread, if it is a simulated one.
    pub fn group_here() -> Option<u32> {
        current().map(|(shared, me)| shared.lock().threads[me].group)
    }

    /// Gives the turn back while staying runnable: another thread may run first. A point
    /// where the simulation may interleave (a message sent, a shared word read).
    pub fn yield_now() {
        if let Some((shared, me)) = current() {
            park(&shared, me, None, None, true);
        }
    }
}

/// The seeds a simulation test runs: `{var}_SEED=S` only `S` (to replay one), else
/// `{var}_SEEDS=N` (default `default`) seeds from `{var}_FIRST` (default 0).
pub fn seeds(var: &str, default: u64) -> Vec<u64> {
    let read = |suffix: &str| {
        std::env::var(format!("{var}{suffix}"))
            .ok()
            .and_then(|s| s.parse::<u64>().ok())
    };
    match read("_SEED") {
        Some(s) => vec![s],
        None => {
            let first = read("_FIRST").unwrap_or(0);
            (first..first.saturating_add(read("_SEEDS").unwrap_or(default))).collect()
        }
    }
}

/// The threads of one group of a world, as a [`crate::Spawn`].
#[derive(Clone)]
pub struct GroupThreads {
    world: Turnstile,
    group: u32,
}

impl crate::Spawn for GroupThreads {
    fn spawn(&self, name: &str, work: crate::Work) -> std::io::Result<()> {
        self.world
            .spawn(self.group, &format!("{}/{name}", self.group), work);
        Ok(())
    }
}

/// The CPU a new world's threads run on: the CPUs the calling thread may use, taken in turn
/// by the worlds made one after another (so tests running worlds in parallel use them all);
/// `None` if they cannot be read. One thread of a world runs at a time anyway, and a turn
/// handed to a thread on the same CPU is a plain switch, where one on another CPU must wake
/// that CPU: on small virtual machines that wake-up costs more than the turn's work.
fn world_cpu() -> Option<usize> {
    static WORLDS: AtomicUsize = AtomicUsize::new(0);
    // SAFETY: a zeroed cpu_set_t is a valid empty set, which sched_getaffinity fills (for the
    // calling thread) within its size; CPU_ISSET reads within it.
    let allowed: Vec<usize> = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return None;
        }
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &set))
            .collect()
    };
    let n = WORLDS.fetch_add(1, Ordering::Relaxed);
    allowed.get(n % allowed.len().max(1)).copied()
}

/// Keeps the calling thread on `cpu` (best effort: where it cannot, it runs anywhere, only
/// slower).
fn run_on(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET writes within it, and
    // sched_setaffinity reads it for the calling thread only.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

/// Blocks until `tid` holds the turn; a killed thread unwinds instead.
fn wait_turn(shared: &Shared, tid: usize) {
    let mut s = shared.lock();
    let wake = s.threads[tid].wake.clone();
    while s.running != Some(tid) {
        s = wake.wait(s).unwrap_or_else(|p| p.into_inner());
    }
    // A killed thread already unwinding (its destructors wait too) goes on unwinding.
    if s.threads[tid].killed && !std::thread::panicking() {
        drop(s);
        resume_unwind(Box::new(Killed));
    }
}

/// Gives the turn back until a timer at `until`, the gate `gate` opening, or (`runnable`)
/// the driver choosing this thread again, and takes it back.
fn park(shared: &Shared, me: usize, until: Option<Duration>, gate: Option<u64>, runnable: bool) {
    {
        let mut s = shared.lock();
        let t = &mut s.threads[me];
        t.epoch += 1;
        let epoch = t.epoch;
        t.run = if runnable { Run::Runnable } else { Run::Parked };
        if let Some(at) = until {
            s.seq += 1;
            let seq = s.seq;
            s.timers.push(Reverse((at, seq, me, epoch)));
        }
        if let Some(g) = gate {
            s.gates.entry(g).or_default().push((me, epoch));
        }
        shared.hand_on(s);
    }
    wait_turn(shared, me);
}

impl Clock for Turnstile {
    fn now(&self) -> Duration {
        self.shared.lock().now
    }

    fn wall_ns(&self) -> u64 {
        self.shared.wall_origin + self.shared.lock().now.as_nanos() as u64
    }

    /// On a simulated thread: waits `d` of virtual time. Elsewhere (the test driving the
    /// world) there is nothing to wait for: it returns at once.
    fn sleep(&self, d: Duration) {
        if let Some((shared, me)) = current() {
            let until = shared.lock().now + d;
            park(&shared, me, Some(until), None, false);
        }
    }
}

/// A gate simulated threads wait at until it opens ([`crate::Mutex`], [`crate::Bell`]). Ids
/// are unique in the process, so a gate needs no world to be made.
pub(crate) fn new_gate() -> u64 {
    static GATE_IDS: AtomicU64 = AtomicU64::new(1);
    GATE_IDS.fetch_add(1, Ordering::Relaxed)
}

/// The calling thread's world, if it is a simulated thread.
pub(crate) struct Here(Arc<Shared>, usize);

impl Here {
    pub(crate) fn now() -> Option<Here> {
        current().map(|(s, me)| Here(s, me))
    }

    /// Virtual time now.
    pub(crate) fn time(&self) -> Duration {
        self.0.lock().now
    }

    /// Gives the turn back until `gate` opens or virtual time reaches `until`.
    pub(crate) fn wait_at(&self, gate: u64, until: Option<Duration>) {
        park(&self.0, self.1, until, Some(gate), false);
    }

    /// Whether this thread's process was killed (it is unwinding, or will at its next wait).
    pub(crate) fn killed(&self) -> bool {
        self.0.lock().threads[self.1].killed
    }

    /// Lets every thread waiting at `gate` run again.
    pub(crate) fn open(&self, gate: u64) {
        open_gate(&self.0, gate);
    }
}

fn open_gate(shared: &Shared, gate: u64) {
    let mut s = shared.lock();
    if let Some(waiters) = s.gates.remove(&gate) {
        for (tid, epoch) in waiters {
            s.wake(tid, epoch);
        }
    }
}
