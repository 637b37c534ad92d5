//! Properties of the simulator itself: exact replay from a seed, interleaving, kills, pauses,
//! liveness detection, and speed.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::{Duration, Instant};

use rackfs_verbs::sim::{RunOutcome, Sim, SimConfig, SIM_RKEY};
use rackfs_verbs::{Batch, RemoteAddr};

/// Runs 4 clients racing CAS increments and returns the order in which they won.
fn race(seed: u64) -> Vec<usize> {
    let mut sim = Sim::new(SimConfig {
        seed,
        ..SimConfig::default()
    });
    let log = Rc::new(RefCell::new(Vec::new()));
    let addr = RemoteAddr::new(SIM_RKEY, 0);
    for i in 0..4 {
        let c = sim.add_client();
        let qp = sim.handle().connect(c);
        let log = log.clone();
        sim.spawn(c, async move {
            let mut seen = 0;
            let mut wins = 0;
            while wins < 25 {
                let mut b = Batch::new();
                let id = b.cas(addr, seen, seen + 1);
                let old = qp.post(b).await.unwrap().value(id).unwrap();
                if old == seen {
                    wins += 1;
                    log.borrow_mut().push(i);
                    seen += 1;
                } else {
                    seen = old;
                }
            }
        });
    }
    assert_eq!(sim.run(Duration::from_secs(10)), RunOutcome::Finished);
    let v = log.borrow().clone();
    v
}

#[test]
fn a_seed_replays_exactly_and_seeds_differ() {
    let a = race(7);
    assert_eq!(a.len(), 100);
    assert_eq!(a, race(7), "same seed, same interleaving");
    let distinct: std::collections::HashSet<Vec<usize>> = (0..8).map(race).collect();
    assert!(
        distinct.len() >= 6,
        "different seeds interleave differently ({} distinct of 8)",
        distinct.len()
    );
}

#[test]
fn requests_are_delayed_in_virtual_time() {
    let mut sim = Sim::new(SimConfig {
        seed: 1,
        min_delay: Duration::from_micros(10),
        max_delay: Duration::from_micros(10),
        tail_ppm: 0,
        intra_batch_delay: Duration::ZERO,
        ..SimConfig::default()
    });
    let c = sim.add_client();
    let qp = sim.handle().connect(c);
    let h = sim.handle();
    let took = Rc::new(RefCell::new(Duration::ZERO));
    let t = took.clone();
    sim.spawn(c, async move {
        let start = h.now();
        qp.post(Batch::new()).await.unwrap();
        *t.borrow_mut() = h.now() - start;
        // Sleeping advances virtual time exactly.
        let before = h.now();
        qp.clock().sleep(Duration::from_millis(3)).await;
        assert_eq!(h.now() - before, Duration::from_millis(3));
    });
    assert_eq!(sim.run(Duration::from_secs(1)), RunOutcome::Finished);
    assert_eq!(
        *took.borrow(),
        Duration::from_micros(20),
        "one delay out, one back"
    );
}

#[test]
fn killed_clients_stop_and_their_unexecuted_requests_vanish() {
    let mut sim = Sim::new(SimConfig {
        seed: 3,
        ..SimConfig::default()
    });
    let addr = RemoteAddr::new(SIM_RKEY, 64);
    let victim = sim.add_client();
    let qp = sim.handle().connect(victim);
    let progress = Rc::new(RefCell::new(0u64));
    let p = progress.clone();
    sim.spawn(victim, async move {
        loop {
            // Long batches: some requests will still be queued when the kill lands.
            let mut b = Batch::new();
            for _ in 0..50 {
                b.faa(addr, 1);
            }
            if qp.post(b).await.is_err() {
                return;
            }
            *p.borrow_mut() += 50;
        }
    });
    let killer = sim.add_client();
    let h = sim.handle();
    sim.spawn(killer, async move {
        h.clock_sleep(Duration::from_micros(500)).await;
        h.kill(victim);
    });
    assert_eq!(
        sim.run(Duration::from_secs(1)),
        RunOutcome::Finished,
        "the victim's task is dropped"
    );
    let mut word = [0u8; 8];
    sim.handle().region().read(64, &mut word).unwrap();
    let executed = u64::from_le_bytes(word);
    let acknowledged = *progress.borrow();
    assert!(acknowledged > 0);
    assert!(
        executed >= acknowledged,
        "acknowledged requests were executed"
    );
    assert!(
        executed < acknowledged + 100,
        "requests queued at the kill did not all run"
    );
    assert!(sim.handle().is_killed(victim));
}

#[test]
fn paused_clients_resume_and_stalls_are_detected() {
    let mut sim = Sim::new(SimConfig {
        seed: 5,
        ..SimConfig::default()
    });
    let c = sim.add_client();
    let h = sim.handle();
    let woke_at = Rc::new(RefCell::new(Duration::ZERO));
    let w = woke_at.clone();
    let h2 = h.clone();
    sim.spawn(c, async move {
        h2.clock_sleep(Duration::from_micros(1)).await;
        *w.borrow_mut() = h2.now();
    });
    h.pause(c, Duration::from_millis(50));
    assert_eq!(sim.run(Duration::from_secs(1)), RunOutcome::Finished);
    assert!(
        *woke_at.borrow() >= Duration::from_millis(50),
        "a paused task does not run"
    );

    // A task waiting on something that never happens is a stall, not a hang.
    let c = sim.add_client();
    sim.spawn(c, std::future::pending());
    assert_eq!(sim.run(Duration::from_secs(1)), RunOutcome::Stalled);
}

#[test]
fn throughput_of_simulated_verbs() {
    // Reported, not asserted against a figure: the run must simply complete its bounded work.
    let mut sim = Sim::new(SimConfig {
        seed: 9,
        ..SimConfig::default()
    });
    let addr = RemoteAddr::new(SIM_RKEY, 0);
    for _ in 0..8 {
        let c = sim.add_client();
        let qp = sim.handle().connect(c);
        sim.spawn(c, async move {
            for _ in 0..2500 {
                let mut b = Batch::new();
                for _ in 0..8 {
                    b.faa(addr, 1);
                }
                qp.post(b).await.unwrap();
            }
        });
    }
    let t = Instant::now();
    assert_eq!(sim.run(Duration::from_secs(100)), RunOutcome::Finished);
    let n = sim.handle().verbs_executed();
    assert_eq!(n, 8 * 2500 * 8);
    eprintln!(
        "sim: {n} verbs in {:?} = {:.0} verbs/s",
        t.elapsed(),
        n as f64 / t.elapsed().as_secs_f64()
    );
}
