//! Citron range locks under the deterministic simulator: random ranges, random delays (some
//! beyond Twait), paused clients, and an oracle that fails the run if two overlapping ranges
//! are ever held at once or a request takes longer than a bound. A failure names its seed;
//! `RACKFS_LOCK_SEED=N` replays just that one.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use std::cell::Cell;

use rackfs_locks::tree::{slot_offset, CLIENT_SLOTS, RETIRED, STATE_OFFSET};
use rackfs_locks::{Geometry, LockConfig, LockError, LockTree};
use rackfs_verbs::sim::{RunOutcome, Sim, SimConfig, SimHandle, SIM_RKEY};
use rackfs_verbs::{Batch, QueuePair, RemoteAddr};

#[derive(Default)]
struct Oracle {
    held: Vec<(usize, u64, u64)>,
    violations: Vec<String>,
    completed: usize,
    longest_wait: Duration,
    escalations: u64,
    replacements: u64,
    recoveries: u64,
}

impl Oracle {
    fn grant(&mut self, c: usize, l: u64, r: u64, now: Duration) {
        for &(other, a, b) in self.held.iter().filter(|&&(_, a, b)| a < r && l < b) {
            let msg = format!(
                "client {c} got [{l}, {r}) while client {other} holds [{a}, {b}) at {now:?}"
            );
            self.violations.push(msg);
        }
        self.held.push((c, l, r));
    }

    fn drop_held(&mut self, c: usize, l: u64, r: u64) {
        self.held
            .retain(|&(who, a, b)| !(who == c && a == l && b == r));
    }

    /// A run's verdict: no overlap seen, every live client's `expected` requests completed,
    /// none waited past `bound`.
    fn verdict(
        &self,
        seed: u64,
        outcome: RunOutcome,
        expected: usize,
        now: Duration,
        bound: Duration,
    ) -> Result<(), String> {
        if let Some(v) = self.violations.first() {
            return Err(format!("seed {seed}: mutual exclusion violated: {v}"));
        }
        if outcome != RunOutcome::Finished || self.completed < expected {
            return Err(format!(
                "seed {seed}: liveness: {outcome:?} after {} requests ({expected} expected from live clients) at {now:?}",
                self.completed,
            ));
        }
        if self.longest_wait > bound {
            return Err(format!(
                "seed {seed}: a request waited {:?} (bound {bound:?})",
                self.longest_wait
            ));
        }
        Ok(())
    }
}

struct Scenario {
    clients: usize,
    ops: usize,
    height: u32,
    k: usize,
    m: u32,
    pauses: bool,
    leaf_retries: u32,
    /// Clients sometimes replace the tree (scale-up or scale-down) while holding all of it.
    replacements: bool,
    /// Clients killed mid-run; a recovery task plays the memory node's part.
    kills: usize,
}

impl Scenario {
    fn new(clients: usize, ops: usize, height: u32, m: u32) -> Scenario {
        Scenario {
            clients,
            ops,
            height,
            k: 2,
            m,
            pauses: true,
            leaf_retries: 8,
            replacements: false,
            kills: 0,
        }
    }
}

/// A random range: aligned to a node, unaligned, tiny, large, or reaching past the tree.
fn pick_range(h: &SimHandle, n: u64) -> (u64, u64) {
    match h.random_below(6) {
        0 => {
            let span = 64u64 << (2 * h.random_below(3));
            let span = span.min(n);
            let i = h.random_below(n / span);
            (i * span, (i + 1) * span)
        }
        1 => {
            let l = h.random_below(n);
            (l, l + 1)
        }
        2 => {
            let l = h.random_below(n - 1);
            (l, (l + 2 + h.random_below(300)).min(n))
        }
        3 => {
            let l = h.random_below(n);
            (l, (l + 1 + h.random_below(n / 2)).min(n))
        }
        4 => {
            let l = h.random_below(n + 64);
            (l, l + 1 + h.random_below(200))
        }
        _ => {
            let l = h.random_below(n / 2);
            (l, l + n / 4 + h.random_below(n / 4))
        }
    }
}

/// Where the current tree is: a published word `height << 56 | offset` at offset 0 of the
/// region, as the file record holds it in the filesystem; trees are bump-allocated after it.
const RECORD: u64 = 0;

fn pack(geo: Geometry, offset: u64) -> u64 {
    (geo.height as u64) << 56 | offset
}

fn unpack(w: u64) -> (Geometry, u64) {
    (
        Geometry {
            height: (w >> 56) as u32,
        },
        w & ((1 << 56) - 1),
    )
}

/// Fresh (zeroed) memory for a tree: the sim region starts zeroed and is never reused here.
fn alloc_tree(next: &Cell<u64>, geo: Geometry) -> u64 {
    let at = next.get();
    next.set(at + LockTree::memory_len(geo).next_multiple_of(64));
    at
}

async fn read_u64(qp: &QueuePair, offset: u64) -> u64 {
    let mut b = Batch::new();
    let id = b.read(RemoteAddr::new(SIM_RKEY, offset), 8);
    let done = qp.post(b).await.expect("post");
    u64::from_le_bytes(done.data(id).expect("read").try_into().expect("8"))
}

/// The memory node's recovery after `dead` died: retire the published tree, wait until no live
/// client has an acquisition or a range in it, publish a fresh one; again if the published tree
/// changed meanwhile (a replacement raced with the recovery).
async fn recover(qp: &QueuePair, h: &SimHandle, next: &Cell<u64>, live: &[bool]) {
    loop {
        let cur = read_u64(qp, RECORD).await;
        let (geo, base) = unpack(cur);
        let mut b = Batch::new();
        b.write_u64(RemoteAddr::new(SIM_RKEY, base + STATE_OFFSET), RETIRED);
        qp.post(b).await.expect("retire");
        loop {
            let mut b = Batch::new();
            let id = b.read(
                RemoteAddr::new(SIM_RKEY, base + slot_offset(0)),
                (CLIENT_SLOTS * 8) as u32,
            );
            let done = qp.post(b).await.expect("slots");
            let slots = done.data(id).expect("slots").to_vec();
            let busy = live
                .iter()
                .enumerate()
                .any(|(c, &alive)| alive && slots[c * 8..c * 8 + 8] != [0u8; 8]);
            if !busy {
                break;
            }
            h.clock_sleep(Duration::from_micros(5)).await;
        }
        let fresh = pack(geo, alloc_tree(next, geo));
        let mut b = Batch::new();
        let id = b.cas(RemoteAddr::new(SIM_RKEY, RECORD), cur, fresh);
        if qp.post(b).await.expect("publish").value(id).expect("cas") == cur {
            return;
        }
    }
}

fn run(seed: u64, s: &Scenario) -> Result<u64, String> {
    let mut sim = Sim::new(SimConfig {
        seed,
        region_len: 4 << 20,
        ..SimConfig::default()
    });
    let geo = Geometry { height: s.height };
    // Ranges are drawn over the first tree's span; replacements make trees up to 4x larger or
    // smaller, so parts of the ranges go to the spillover mutex.
    let n = geo.units();
    let cfg = LockConfig {
        k: s.k,
        m: s.m,
        rtt_budget: Duration::from_micros(10),
        poll: Duration::from_micros(2),
        leaf_retries: s.leaf_retries,
    };
    let oracle = Rc::new(RefCell::new(Oracle::default()));
    let next = Rc::new(Cell::new(64));
    let first = alloc_tree(&next, geo);
    sim.handle()
        .region()
        .store(RECORD, pack(geo, first))
        .expect("record");
    let live = Rc::new(RefCell::new(vec![true; s.clients]));
    let mut clients = Vec::new();
    for c in 0..s.clients {
        let id = sim.add_client();
        clients.push(id);
        let qp = sim.handle().connect(id);
        let h = sim.handle();
        let (o, cfg, next) = (oracle.clone(), cfg.clone(), next.clone());
        let (ops, replacements) = (s.ops, s.replacements);
        sim.spawn(id, async move {
            let mut published = 0;
            let mut tree: Option<LockTree> = None;
            for _ in 0..ops {
                let replace = replacements && h.random_below(8) == 0;
                let (l, r) = if replace {
                    (0, u64::MAX)
                } else {
                    pick_range(&h, n)
                };
                let asked = h.now();
                let (g, t) = loop {
                    let w = read_u64(&qp, RECORD).await;
                    if w != published || tree.is_none() {
                        let (geo, base) = unpack(w);
                        tree = Some(LockTree::new(
                            qp.clone(),
                            RemoteAddr::new(SIM_RKEY, base),
                            geo,
                            cfg.clone(),
                            c as u16,
                        ));
                        published = w;
                    }
                    let t = tree.take().expect("tree");
                    match t.acquire(l, r).await {
                        Ok(g) => break (g, t),
                        Err(LockError::Retired) => {
                            tree = Some(t);
                            h.clock_sleep(Duration::from_micros(2)).await;
                        }
                        Err(e) => panic!("acquire: {e}"),
                    }
                };
                {
                    let mut o = o.borrow_mut();
                    let waited = h.now() - asked;
                    o.longest_wait = o.longest_wait.max(waited);
                    o.grant(c, l, r, h.now());
                }
                h.clock_sleep(Duration::from_nanos(h.random_below(30_000)))
                    .await;
                o.borrow_mut().drop_held(c, l, r);
                if replace {
                    // Holding the whole tree: retire it, then publish a replacement (the memory
                    // node does both in one RPC; here a client dying in between is recovered).
                    let old = t.geometry().height;
                    let height = match h.random_below(3) {
                        0 => old.saturating_sub(1),
                        1 => old,
                        _ => (old + 1).min(4),
                    };
                    let (_, base) = unpack(published);
                    let mut b = Batch::new();
                    b.write_u64(RemoteAddr::new(SIM_RKEY, base + STATE_OFFSET), RETIRED);
                    qp.post(b).await.expect("retire");
                    let geo = Geometry { height };
                    let fresh = pack(geo, alloc_tree(&next, geo));
                    let mut b = Batch::new();
                    let id = b.cas(RemoteAddr::new(SIM_RKEY, RECORD), published, fresh);
                    if qp.post(b).await.expect("publish").value(id).expect("cas") == published {
                        o.borrow_mut().replacements += 1;
                    }
                }
                t.release(g).await.expect("release");
                o.borrow_mut().escalations += t.escalations();
                tree = Some(t);
                o.borrow_mut().completed += 1;
                h.clock_sleep(Duration::from_nanos(h.random_below(5_000)))
                    .await;
            }
        });
    }
    if s.pauses || s.kills > 0 {
        let ctl = sim.add_client();
        let qp = sim.handle().connect(ctl);
        let h = sim.handle();
        let victims = clients.clone();
        let (kills, pauses) = (s.kills, s.pauses);
        let (o, live, next) = (oracle.clone(), live.clone(), next.clone());
        sim.spawn(ctl, async move {
            if pauses {
                for _ in 0..4 {
                    h.clock_sleep(Duration::from_micros(h.random_below(300)))
                        .await;
                    let v = h.random_below(victims.len() as u64) as usize;
                    // Some pauses last far beyond Twait.
                    h.pause(victims[v], Duration::from_micros(h.random_below(200)));
                }
            }
            for _ in 0..kills {
                h.clock_sleep(Duration::from_micros(h.random_below(400)))
                    .await;
                let v = h.random_below(victims.len() as u64) as usize;
                if !live.borrow()[v] {
                    continue;
                }
                h.kill(victims[v]);
                live.borrow_mut()[v] = false;
                // A dead client protects nothing any more; its requests no longer count.
                o.borrow_mut().held.retain(|&(who, _, _)| who != v);
                let alive = live.borrow().clone();
                recover(&qp, &h, &next, &alive).await;
                o.borrow_mut().recoveries += 1;
            }
        });
    }
    let outcome = sim.run(Duration::from_secs(5));
    let o = oracle.borrow();
    let expected = s.ops * live.borrow().iter().filter(|&&a| a).count();
    let bound = Duration::from_millis(500);
    o.verdict(seed, outcome, expected, sim.handle().now(), bound)?;
    Ok(o.escalations)
}

fn seeds(default: u64) -> Vec<u64> {
    match std::env::var("RACKFS_LOCK_SEED") {
        Ok(s) => vec![s.parse().expect("RACKFS_LOCK_SEED is a number")],
        Err(_) => (0..default).collect(),
    }
}

/// Runs `count` seeds; returns how many escalations happened in all.
fn check_many(count: u64, s: &Scenario) -> u64 {
    let mut failures = Vec::new();
    let mut escalations = 0;
    for seed in seeds(count) {
        match run(seed, s) {
            Ok(e) => escalations += e,
            Err(e) => {
                failures.push(e);
                if failures.len() >= 5 {
                    break;
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} failing seed(s), e.g.:\n{}",
        failures.len(),
        failures.join("\n")
    );
    escalations
}

#[test]
fn no_overlapping_holders_small_tree() {
    check_many(4000, &Scenario::new(6, 15, 2, 1));
}

#[test]
fn no_overlapping_holders_deep_tree_beyond_2m() {
    // Height 5 with m = 1: nodes more than 2m levels below an occupied one, the restated
    // protocol's blind spot.
    check_many(4000, &Scenario::new(6, 15, 5, 1));
}

#[test]
fn no_overlapping_holders_default_parameters() {
    check_many(3000, &Scenario::new(8, 12, 3, 4));
}

#[test]
fn hot_leaf_escalates_and_stays_exclusive() {
    // Everyone fights over one leaf with 2 retries before escalating; a lone leaf (height 0)
    // has no parent to escalate to.
    let single = check_many(
        1000,
        &Scenario {
            leaf_retries: 2,
            ..Scenario::new(8, 10, 0, 2)
        },
    );
    let with_parent = check_many(
        1000,
        &Scenario {
            leaf_retries: 2,
            ..Scenario::new(8, 10, 1, 1)
        },
    );
    assert_eq!(single, 0);
    assert!(with_parent > 0, "contended leaves under a parent escalate");
}

#[test]
fn uncontended_acquire_costs_two_round_trips_and_release_one() {
    let mut sim = Sim::new(SimConfig::default());
    let c = sim.add_client();
    let geo = Geometry { height: 3 };
    let tree = Rc::new(LockTree::new(
        sim.handle().connect(c),
        RemoteAddr::new(SIM_RKEY, 4096),
        geo,
        LockConfig::default(),
        0,
    ));
    let counts = Rc::new(RefCell::new(Vec::new()));
    let (t, k) = (tree.clone(), counts.clone());
    sim.spawn(c, async move {
        // A range inside one leaf, then one straddling two leaves: two round trips to acquire
        // either, one to release.
        for (l, r) in [(70, 80), (100, 160)] {
            let before = t.round_trips();
            let g = t.acquire(l, r).await.unwrap();
            let acquired = t.round_trips();
            t.release(g).await.unwrap();
            k.borrow_mut()
                .push((acquired - before, t.round_trips() - acquired));
        }
    });
    assert_eq!(sim.run(Duration::from_secs(1)), RunOutcome::Finished);
    assert_eq!(*counts.borrow(), vec![(2, 1), (2, 1)]);
}

#[test]
#[ignore = "long run: cargo test --release -p rackfs-locks --test citron_sim -- --ignored"]
fn many_seeds_long_run_of_keepers() {
    check_keeping(10_000, &keep_scenario());
    check_keeping(
        10_000,
        &KeepScenario {
            keeper_workers: 2,
            replacements: true,
            kills: 1,
            zombies: 1,
            wait_bound: Duration::from_millis(20),
            ..keep_scenario()
        },
    );
}

#[test]
#[ignore = "long run: cargo test --release -p rackfs-locks --test citron_sim -- --ignored"]
fn many_seeds_long_run() {
    check_many(20_000, &Scenario::new(8, 20, 4, 2));
    check_many(
        10_000,
        &Scenario {
            replacements: true,
            kills: 2,
            ..Scenario::new(8, 20, 3, 2)
        },
    );
}

#[test]
fn replacements_during_acquisitions_stay_exclusive() {
    // Clients grow and shrink the tree while others acquire on it, on stale views of it and
    // beyond it (the spillover mutex).
    check_many(
        2000,
        &Scenario {
            replacements: true,
            ..Scenario::new(6, 16, 2, 1)
        },
    );
}

#[test]
fn killed_holders_are_recovered_and_others_proceed() {
    // Clients die at random points of their protocol (holding ranges, halfway through an
    // acquisition, holding tickets); the recovery replaces the tree and every live client's
    // requests still complete within the bound, with no overlap.
    check_many(
        2000,
        &Scenario {
            replacements: true,
            kills: 2,
            ..Scenario::new(6, 16, 2, 1)
        },
    );
}

/// A request waiting behind a holder that will never release (its tree lives in a dead
/// primary's memory, which may stay mapped and keep answering) stops once its client moved
/// on to a new session, instead of waiting for ever; until then it waits.
#[test]
fn a_wait_in_a_tree_the_client_moved_on_from_is_given_up() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let mut sim = Sim::new(SimConfig::default());
    let (a, b) = (sim.add_client(), sim.add_client());
    let h = sim.handle();
    let geo = Geometry { height: 3 };
    let at = RemoteAddr::new(SIM_RKEY, 4096);
    let holder = LockTree::new(h.connect(a), at, geo, LockConfig::default(), 0);
    let moved_on = Arc::new(AtomicBool::new(false));
    let flag = moved_on.clone();
    let waiter = LockTree::new(h.connect(b), at, geo, LockConfig::default(), 1)
        .give_up_when(move || flag.load(Ordering::SeqCst));
    // What the waiter's request answered, and when.
    type Answer = (Result<(), String>, Duration);
    let answer: Rc<RefCell<Option<Answer>>> = Rc::default();
    let (got, hh) = (answer.clone(), h.clone());
    sim.spawn(a, async move {
        let held = holder.acquire(0, 100).await.unwrap();
        hh.clock_sleep(Duration::from_millis(50)).await;
        moved_on.store(true, Ordering::SeqCst);
        // Never released.
        std::mem::forget(held);
    });
    let hb = h.clone();
    sim.spawn(b, async move {
        hb.clock_sleep(Duration::from_millis(1)).await;
        let r = waiter.acquire(10, 20).await;
        let r = r.map(|_| ()).map_err(|e| e.to_string());
        *got.borrow_mut() = Some((r, hb.now()));
    });
    assert_eq!(sim.run(Duration::from_secs(5)), RunOutcome::Finished);
    let (r, when) = answer.borrow_mut().take().expect("the waiter answered");
    assert!(r.as_ref().is_err_and(|e| e.contains("given up")), "{r:?}");
    assert!(
        when >= Duration::from_millis(50),
        "gave up at {when:?}, before its client moved on"
    );
}

/// Clients that keep the whole tree between their requests ([`rackfs_locks::keep`]) among
/// clients that do not, each keeper with a ticker task that gives the kept tree back when
/// someone waits for it: a keeper runs many requests in a row, so a waiter that is not let
/// in by a revocation waits for the keeper's whole run, beyond the bound.
struct KeepScenario {
    keepers: usize,
    others: usize,
    keeper_ops: usize,
    other_ops: usize,
    height: u32,
    /// Clients killed mid-run (a keeper may die halfway through giving its tree back).
    kills: usize,
    /// Keepers stopped past their lease: fenced (they moved on from the tree) and recovered
    /// from while stopped, then resumed.
    zombies: usize,
    /// The longest any request may wait.
    wait_bound: Duration,
    /// Tasks (a mount's threads) each keeper runs its requests from, sharing its handles.
    keeper_workers: usize,
    /// Keepers sometimes replace the tree while holding all of it.
    replacements: bool,
    /// Whether the keepers keep (without, the same load on plain Citron).
    keep: bool,
}

/// What a keeping run saw: kept trees taken and given back because someone waited.
#[derive(Default, Debug)]
struct KeepCounts {
    lent: u64,
    revoked: u64,
    /// Ranges lent by a keeper after it was fenced (must stay 0).
    lent_when_fenced: u64,
    /// Grants to fenced clients, whose writes the data nodes refuse.
    refused: u64,
}

fn run_keeping(seed: u64, s: &KeepScenario) -> Result<KeepCounts, String> {
    use rackfs_locks::{KeepBudget, KeepPolicy, Tick};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let mut sim = Sim::new(SimConfig {
        seed,
        region_len: 4 << 20,
        ..SimConfig::default()
    });
    let geo = Geometry { height: s.height };
    let n = geo.units();
    let cfg = LockConfig {
        k: 2,
        m: 1,
        rtt_budget: Duration::from_micros(10),
        poll: Duration::from_micros(2),
        leaf_retries: 8,
    };
    let policy = KeepPolicy {
        streak: 2,
        idle: Duration::from_micros(100),
        backoff: Duration::from_micros(50),
        max_backoff: Duration::from_micros(400),
        budget: None,
    };
    // Each keeper keeps one tree at a time (its handles on successive trees share the place);
    // every place comes back once it is done.
    let budgets: Vec<_> = (0..s.keepers).map(|_| KeepBudget::new(1)).collect();
    let tick = Duration::from_micros(20);
    let oracle = Rc::new(RefCell::new(Oracle::default()));
    let counts = Rc::new(RefCell::new(KeepCounts::default()));
    let next = Rc::new(Cell::new(64));
    let first = alloc_tree(&next, geo);
    sim.handle()
        .region()
        .store(RECORD, pack(geo, first))
        .expect("record");
    let clients = s.keepers + s.others;
    let live = Rc::new(RefCell::new(vec![true; clients]));
    let fenced: Vec<Arc<AtomicBool>> = (0..clients).map(|_| Arc::default()).collect();
    let mut ids = Vec::new();
    for (c, gone) in fenced.iter().enumerate() {
        let id = sim.add_client();
        ids.push(id);
        let qp = sim.handle().connect(id);
        let h = sim.handle();
        let keeps = s.keep && c < s.keepers;
        let ops = if c < s.keepers {
            s.keeper_ops
        } else {
            s.other_ops
        };
        let (o, k, cfg) = (oracle.clone(), counts.clone(), cfg.clone());
        let policy = KeepPolicy {
            budget: budgets.get(c).cloned(),
            ..policy.clone()
        };
        let gone = gone.clone();
        // The trees this client made handles on; its ticker ticks every one that keeps.
        let trees: Rc<RefCell<Vec<Rc<LockTree>>>> = Rc::default();
        // Tasks of this client still running.
        let running = Rc::new(Cell::new(1usize));
        if keeps {
            let (h, trees, running, k) = (h.clone(), trees.clone(), running.clone(), k.clone());
            sim.spawn(id, async move {
                loop {
                    let all: Vec<Rc<LockTree>> = trees.borrow().clone();
                    let mut keeping = false;
                    for t in all {
                        match t.keep_tick().await {
                            Ok(Tick::Kept) => keeping = true,
                            Ok(Tick::Yielded) => k.borrow_mut().revoked += 1,
                            Ok(Tick::Idle) => {}
                            Err(e) => panic!("keep tick: {e}"),
                        }
                    }
                    if running.get() == 0 && !keeping {
                        return;
                    }
                    h.clock_sleep(tick).await;
                }
            });
        }
        // A keeping client runs its requests from several tasks (a mount's threads) on one
        // handle per published tree; one in ten of a keeper's requests replaces the tree
        // while holding all of it (growth, a truncate's shrink).
        let workers = if c < s.keepers { s.keeper_workers } else { 1 };
        let current: Rc<RefCell<(u64, Option<Rc<LockTree>>)>> = Rc::default();
        running.set(workers);
        for w in 0..workers {
            let per = ops / workers + usize::from(w < ops % workers);
            let (h, qp, o, k, cfg, policy, gone, trees, running, current, next) = (
                h.clone(),
                qp.clone(),
                o.clone(),
                k.clone(),
                cfg.clone(),
                policy.clone(),
                gone.clone(),
                trees.clone(),
                running.clone(),
                current.clone(),
                next.clone(),
            );
            let replaces = s.replacements && c < s.keepers;
            sim.spawn(id, async move {
                let over = || running.set(running.get() - 1);
                for _ in 0..per {
                    let replace = replaces && h.random_below(10) == 0;
                    let (l, r) = match replace {
                        true => (0, u64::MAX),
                        false => pick_range(&h, n),
                    };
                    let asked = h.now();
                    let (g, t, published) = loop {
                        let word = read_u64(&qp, RECORD).await;
                        let t = {
                            let mut cur = current.borrow_mut();
                            if word != cur.0 || cur.1.is_none() {
                                let (geo, base) = unpack(word);
                                let gone = gone.clone();
                                let mut t = LockTree::new(
                                    qp.clone(),
                                    RemoteAddr::new(SIM_RKEY, base),
                                    geo,
                                    cfg.clone(),
                                    c as u16,
                                )
                                .give_up_when(move || gone.load(Ordering::SeqCst));
                                if keeps {
                                    t = t.keeping(policy.clone());
                                }
                                let t = Rc::new(t);
                                trees.borrow_mut().push(t.clone());
                                *cur = (word, Some(t));
                            }
                            cur.1.clone().expect("tree")
                        };
                        match t.acquire(l, r).await {
                            Ok(g) => {
                                if g.from_kept() {
                                    k.borrow_mut().lent += 1;
                                }
                                break (g, t, word);
                            }
                            Err(LockError::Retired) => {
                                h.clock_sleep(Duration::from_micros(2)).await;
                            }
                            Err(LockError::GivenUp) => {
                                // Fenced while stopped: this client is over.
                                return over();
                            }
                            Err(e) => panic!("acquire: {e}"),
                        }
                    };
                    if gone.load(Ordering::SeqCst) {
                        // Fenced: what it writes under this range the data nodes refuse (an
                        // acquisition in flight while it was stopped may still be granted).
                        // A kept tree must lend it nothing.
                        let mut k = k.borrow_mut();
                        k.refused += 1;
                        k.lent_when_fenced += g.from_kept() as u64;
                        return over();
                    }
                    {
                        let mut o = o.borrow_mut();
                        let waited = h.now() - asked;
                        o.longest_wait = o.longest_wait.max(waited);
                        o.grant(c, l, r, h.now());
                    }
                    h.clock_sleep(Duration::from_nanos(h.random_below(30_000)))
                        .await;
                    o.borrow_mut().drop_held(c, l, r);
                    if replace {
                        // Holding the whole tree: retire it and publish a replacement (the
                        // memory node does both in one RPC), then lend nothing more from it.
                        let (_, base) = unpack(published);
                        let mut b = Batch::new();
                        b.write_u64(RemoteAddr::new(SIM_RKEY, base + STATE_OFFSET), RETIRED);
                        qp.post(b).await.expect("retire");
                        let geo = Geometry {
                            height: 1 + h.random_below(3) as u32,
                        };
                        let fresh = pack(geo, alloc_tree(&next, geo));
                        let mut b = Batch::new();
                        b.cas(RemoteAddr::new(SIM_RKEY, RECORD), published, fresh);
                        qp.post(b).await.expect("publish");
                        t.stop_lending();
                    }
                    t.release(g).await.expect("release");
                    if t.replaced() {
                        t.give_back_kept().await.expect("replaced tree given back");
                    }
                    o.borrow_mut().completed += 1;
                    h.clock_sleep(Duration::from_nanos(h.random_below(5_000)))
                        .await;
                }
                over();
            });
        }
    }
    {
        let ctl = sim.add_client();
        let qp = sim.handle().connect(ctl);
        let h = sim.handle();
        let (kills, zombies, keepers) = (s.kills, s.zombies, s.keepers);
        let (o, live, next, ids) = (oracle.clone(), live.clone(), next.clone(), ids.clone());
        sim.spawn(ctl, async move {
            for i in 0..kills + zombies {
                h.clock_sleep(Duration::from_micros(200 + h.random_below(800)))
                    .await;
                let zombie = i >= kills;
                // Zombies are keepers, stopped while they may keep the tree.
                let among = if zombie { keepers } else { ids.len() };
                let v = h.random_below(among as u64) as usize;
                if !live.borrow()[v] {
                    continue;
                }
                if zombie {
                    // Its lease lapses while it is stopped: the primary fences its session
                    // (it has moved on from the tree) and recovers the tree without it.
                    h.pause(ids[v], Duration::from_millis(2));
                    fenced[v].store(true, Ordering::SeqCst);
                } else {
                    h.kill(ids[v]);
                }
                live.borrow_mut()[v] = false;
                // A dead or fenced client protects nothing any more.
                o.borrow_mut().held.retain(|&(who, _, _)| who != v);
                let alive = live.borrow().clone();
                recover(&qp, &h, &next, &alive).await;
                o.borrow_mut().recoveries += 1;
            }
        });
    }
    let outcome = sim.run(Duration::from_secs(5));
    let o = oracle.borrow();
    let live = live.borrow();
    let expected: usize = (0..clients)
        .filter(|&c| live[c])
        .map(|c| {
            if c < s.keepers {
                s.keeper_ops
            } else {
                s.other_ops
            }
        })
        .sum();
    if std::env::var("RACKFS_KEEP_WAITS").is_ok() {
        eprintln!("seed {seed}: longest wait {:?}", o.longest_wait);
    }
    o.verdict(seed, outcome, expected, sim.handle().now(), s.wait_bound)?;
    if let Some(c) = (0..s.keepers).find(|&c| live[c] && s.keep && budgets[c].left() != 1) {
        return Err(format!(
            "seed {seed}: keeper {c} never got its keeping place back"
        ));
    }
    let c = std::mem::take(&mut *counts.borrow_mut());
    Ok(c)
}

fn check_keeping(count: u64, s: &KeepScenario) -> KeepCounts {
    let mut failures = Vec::new();
    let mut total = KeepCounts::default();
    for seed in seeds(count) {
        match run_keeping(seed, s) {
            Ok(c) => {
                total.lent += c.lent;
                total.revoked += c.revoked;
                total.lent_when_fenced += c.lent_when_fenced;
                total.refused += c.refused;
            }
            Err(e) => {
                failures.push(e);
                if failures.len() >= 5 {
                    break;
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} failing seed(s), e.g.:\n{}",
        failures.len(),
        failures.join("\n")
    );
    total
}

fn keep_scenario() -> KeepScenario {
    KeepScenario {
        keepers: 2,
        others: 2,
        keeper_ops: 300,
        other_ops: 10,
        height: 2,
        kills: 0,
        zombies: 0,
        wait_bound: Duration::from_millis(4),
        keeper_workers: 1,
        replacements: false,
        keep: true,
    }
}

#[test]
fn kept_trees_are_given_back_to_waiters_and_stay_exclusive() {
    let c = check_keeping(1500, &keep_scenario());
    assert!(c.lent > 0, "keepers lent ranges from kept trees: {c:?}");
    assert!(c.revoked > 0, "kept trees were given back: {c:?}");
}

#[test]
fn keepers_killed_mid_handover_are_recovered() {
    check_keeping(
        1500,
        &KeepScenario {
            kills: 2,
            ..keep_scenario()
        },
    );
}

#[test]
fn a_keeper_stopped_past_its_lease_lends_nothing_when_it_resumes() {
    let c = check_keeping(
        1500,
        &KeepScenario {
            zombies: 2,
            ..keep_scenario()
        },
    );
    assert_eq!(c.lent_when_fenced, 0, "{c:?}");
}

#[test]
#[ignore = "prints the longest waits of plain Citron under the keepers' load"]
fn plain_citron_under_the_keepers_load() {
    for (workers, replacements) in [(1, false), (2, true)] {
        check_keeping(
            200,
            &KeepScenario {
                keep: false,
                wait_bound: Duration::from_secs(1),
                keeper_workers: workers,
                replacements,
                ..keep_scenario()
            },
        );
    }
}

/// A keeper that replaces the tree itself (growth, a truncate's shrink) is lent the whole
/// range for it; its other requests waiting meanwhile must not be lent ranges of the retired
/// tree once the whole comes back (another client may be granted them in the published one):
/// after [`LockTree::stop_lending`] they fail as `Retired` and retry on the published tree.
#[test]
fn a_keeper_that_replaces_its_tree_lends_nothing_more_from_it() {
    use rackfs_locks::KeepPolicy;
    let mut sim = Sim::new(SimConfig {
        seed: 1,
        region_len: 4 << 20,
        ..SimConfig::default()
    });
    let geo = Geometry { height: 2 };
    let cfg = LockConfig {
        k: 2,
        m: 1,
        rtt_budget: Duration::from_micros(10),
        poll: Duration::from_micros(2),
        leaf_retries: 8,
    };
    let policy = KeepPolicy {
        streak: 2,
        idle: Duration::from_millis(10),
        ..KeepPolicy::default()
    };
    let oracle = Rc::new(RefCell::new(Oracle::default()));
    // 1: the keeper holds the whole range for its replacement; 2: the new tree is published.
    let phase = Rc::new(Cell::new(0u32));
    let retried = Rc::new(Cell::new(false));
    let next = Rc::new(Cell::new(64));
    let first = alloc_tree(&next, geo);
    sim.handle()
        .region()
        .store(RECORD, pack(geo, first))
        .expect("record");
    let a = sim.add_client();
    let qa = sim.handle().connect(a);
    let keeper = Rc::new(
        LockTree::new(
            qa.clone(),
            RemoteAddr::new(SIM_RKEY, first),
            geo,
            cfg.clone(),
            0,
        )
        .keeping(policy),
    );
    // An acquisition of [10, 20) by `client` with handle `tree`, retried on the published tree
    // while retired; held 30 us under the oracle.
    let handle = sim.handle();
    let lock_10_20 = |client: usize, mut tree: Rc<LockTree>, qp: QueuePair| {
        let (h, o, retried, cfg) = (handle.clone(), oracle.clone(), retried.clone(), cfg.clone());
        async move {
            loop {
                match tree.acquire(10, 20).await {
                    Ok(g) => {
                        o.borrow_mut().grant(client, 10, 20, h.now());
                        h.clock_sleep(Duration::from_micros(30)).await;
                        o.borrow_mut().drop_held(client, 10, 20);
                        tree.release(g).await.expect("release");
                        return;
                    }
                    Err(LockError::Retired) => {
                        retried.set(true);
                        let (geo, base) = unpack(read_u64(&qp, RECORD).await);
                        tree = Rc::new(LockTree::new(
                            qp.clone(),
                            RemoteAddr::new(SIM_RKEY, base),
                            geo,
                            cfg.clone(),
                            client as u16,
                        ));
                        h.clock_sleep(Duration::from_micros(2)).await;
                    }
                    Err(e) => panic!("acquire: {e}"),
                }
            }
        }
    };
    {
        let (t, h, next, qa, phase) = (
            keeper.clone(),
            sim.handle(),
            next.clone(),
            qa.clone(),
            phase.clone(),
        );
        sim.spawn(a, async move {
            for i in 0..3 {
                let g = t.acquire(i, i + 1).await.expect("acquire");
                t.release(g).await.expect("release");
            }
            let whole = t.acquire(0, u64::MAX).await.expect("whole");
            assert!(whole.from_kept(), "the keeper lends itself the whole range");
            phase.set(1);
            h.clock_sleep(Duration::from_micros(5)).await;
            // The service's growth: the old tree retired, a larger one published.
            let mut b = Batch::new();
            b.write_u64(RemoteAddr::new(SIM_RKEY, first + STATE_OFFSET), RETIRED);
            qa.post(b).await.expect("retire");
            let grown = Geometry { height: 3 };
            let mut b = Batch::new();
            b.write_u64(
                RemoteAddr::new(SIM_RKEY, RECORD),
                pack(grown, alloc_tree(&next, grown)),
            );
            qa.post(b).await.expect("publish");
            t.stop_lending();
            phase.set(2);
            t.release(whole).await.expect("give back");
            t.give_back_kept().await.expect("kept tree given back");
        });
    }
    {
        let (h, phase, t) = (sim.handle(), phase.clone(), keeper.clone());
        let other_thread = lock_10_20(0, t, qa.clone());
        sim.spawn(a, async move {
            while phase.get() < 1 {
                h.clock_sleep(Duration::from_micros(1)).await;
            }
            other_thread.await;
        });
    }
    {
        let b = sim.add_client();
        let qb = sim.handle().connect(b);
        let (h, phase) = (sim.handle(), phase.clone());
        let stale = Rc::new(LockTree::new(
            qb.clone(),
            RemoteAddr::new(SIM_RKEY, first),
            geo,
            cfg.clone(),
            1,
        ));
        let other_mount = lock_10_20(1, stale, qb);
        sim.spawn(b, async move {
            while phase.get() < 2 {
                h.clock_sleep(Duration::from_micros(1)).await;
            }
            other_mount.await;
        });
    }
    assert_eq!(sim.run(Duration::from_secs(1)), RunOutcome::Finished);
    let o = oracle.borrow();
    assert!(o.violations.is_empty(), "{:?}", o.violations);
    assert!(
        retried.get(),
        "the keeper's other request retried on the new tree"
    );
    assert!(!keeper.keeps(), "the replaced tree was given back");
}

/// Whole-tree requests make waits longer under plain Citron too (up to 7.7 ms over 200
/// seeds of this load without keeping, `plain_citron_under_the_keepers_load`): the bound
/// here is for liveness, the first scenario's for revocation.
#[test]
fn keepers_with_several_threads_that_replace_their_tree_stay_exclusive() {
    let c = check_keeping(
        1500,
        &KeepScenario {
            keeper_workers: 2,
            replacements: true,
            kills: 1,
            wait_bound: Duration::from_millis(20),
            ..keep_scenario()
        },
    );
    assert!(c.lent > 0 && c.revoked > 0, "{c:?}");
}
