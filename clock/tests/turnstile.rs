//! The turnstile: threads run one at a time in an order the seed decides, on virtual time,
//! and what goes wrong (a stall, a panic, a thread stuck outside the simulation) is reported
//! instead of hanging.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rackfs_clock::turnstile::Outcome;
use rackfs_clock::{Bell, Mutex};
use rackfs_clock::{Clock, Turnstile};

/// Three threads append their name to a shared log five times each, yielding in between;
/// returns the log and the schedule's fingerprint.
fn interleaving(seed: u64) -> (Vec<&'static str>, (u64, u64)) {
    let world = Turnstile::new(seed);
    let log = Arc::new(Mutex::new(Vec::new()));
    for name in ["a", "b", "c"] {
        let log = log.clone();
        world.spawn(0, name, move || {
            for _ in 0..5 {
                log.lock().unwrap().push(name);
                Turnstile::yield_now();
            }
        });
    }
    assert_eq!(world.run(Duration::from_secs(1)), Outcome::Finished);
    let out = log.lock().unwrap().clone();
    (out, world.schedule())
}

#[test]
fn a_seed_replays_its_interleaving_and_seeds_differ() {
    let first = interleaving(7);
    assert_eq!(first.0.len(), 15);
    for _ in 0..5 {
        assert_eq!(interleaving(7), first, "the same seed, the same schedule");
    }
    let distinct: std::collections::HashSet<Vec<&str>> =
        (0..20).map(|s| interleaving(s).0).collect();
    assert!(
        distinct.len() > 10,
        "seeds give other interleavings: {}",
        distinct.len()
    );
}

#[test]
fn sleeps_pass_on_virtual_time_in_no_real_time() {
    let world = Turnstile::new(1);
    let woke = Arc::new(Mutex::new(Vec::new()));
    for (name, secs) in [("late", 3600u64), ("early", 60)] {
        let (w, clock, woke) = (world.clone(), world.clone(), woke.clone());
        w.spawn(0, name, move || {
            clock.sleep(Duration::from_secs(secs));
            woke.lock().unwrap().push((name, clock.now()));
        });
    }
    let started = Instant::now();
    assert_eq!(world.run(Duration::from_secs(7200)), Outcome::Finished);
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(
        *woke.lock().unwrap(),
        [
            ("early", Duration::from_secs(60)),
            ("late", Duration::from_secs(3600))
        ]
    );
    assert_eq!(world.now(), Duration::from_secs(3600));
}

#[test]
fn a_time_limit_stops_the_world_and_a_second_run_goes_on() {
    let world = Turnstile::new(2);
    let clock = world.clone();
    world.spawn(0, "ticker", move || {
        for _ in 0..10 {
            clock.sleep(Duration::from_secs(1));
        }
    });
    assert_eq!(world.run(Duration::from_millis(4500)), Outcome::TimeLimit);
    assert_eq!(world.now(), Duration::from_millis(4500));
    assert_eq!(world.run(Duration::from_secs(60)), Outcome::Finished);
    assert_eq!(world.now(), Duration::from_secs(10));
}

#[test]
fn a_thread_waits_for_a_mutex_held_across_a_sleep() {
    let world = Turnstile::new(3);
    let m = Arc::new(Mutex::new(0u32));
    let got_at = Arc::new(Mutex::new(None));
    let (m1, clock) = (m.clone(), world.clone());
    world.spawn(0, "holder", move || {
        let mut g = m1.lock().unwrap();
        clock.sleep(Duration::from_secs(2));
        *g += 1;
    });
    let (m2, clock, got) = (m.clone(), world.clone(), got_at.clone());
    world.spawn(0, "waiter", move || {
        // Let the holder take it first.
        clock.sleep(Duration::from_millis(1));
        let g = m2.lock().unwrap();
        *got.lock().unwrap() = Some((*g, clock.now()));
    });
    assert_eq!(world.run(Duration::from_secs(10)), Outcome::Finished);
    assert_eq!(*got_at.lock().unwrap(), Some((1, Duration::from_secs(2))));
}

#[test]
fn a_condvar_wait_ends_by_notification_or_by_virtual_timeout() {
    let world = Turnstile::new(4);
    let m = Arc::new(Mutex::new(false));
    let cv = Arc::new(Bell::new());
    let seen = Arc::new(Mutex::new(Vec::new()));
    let (m1, cv1, clock, seen1) = (m.clone(), cv.clone(), world.clone(), seen.clone());
    world.spawn(0, "waiter", move || {
        let g = m1.lock().unwrap();
        let (g, timed_out) = cv1.wait_timeout(g, Duration::from_secs(1));
        seen1.lock().unwrap().push((*g, timed_out, clock.now()));
        drop(g);
        let mut g = m1.lock().unwrap();
        while !*g {
            g = cv1.wait(g);
        }
        seen1.lock().unwrap().push((*g, false, clock.now()));
    });
    let (m2, cv2, clock) = (m.clone(), cv.clone(), world.clone());
    world.spawn(0, "notifier", move || {
        clock.sleep(Duration::from_secs(5));
        *m2.lock().unwrap() = true;
        cv2.notify_all();
    });
    assert_eq!(world.run(Duration::from_secs(60)), Outcome::Finished);
    assert_eq!(
        *seen.lock().unwrap(),
        [
            (false, true, Duration::from_secs(1)),
            (true, false, Duration::from_secs(5))
        ]
    );
}

#[test]
fn a_killed_group_unwinds_at_its_next_wait_and_the_rest_goes_on() {
    let world = Turnstile::new(5);
    let m = Arc::new(Mutex::new(0u32));
    let dropped = Arc::new(Mutex::new(false));
    struct Flag(Arc<Mutex<bool>>);
    impl Drop for Flag {
        fn drop(&mut self) {
            *self.0.lock().unwrap() = true;
        }
    }
    let (m1, clock, d) = (m.clone(), world.clone(), dropped.clone());
    world.spawn(1, "node", move || {
        let _flag = Flag(d);
        // Holds the mutex while it waits: killing it must unlock it.
        let _g = m1.lock().unwrap();
        loop {
            clock.sleep(Duration::from_secs(1));
        }
    });
    let (m2, clock, w) = (m.clone(), world.clone(), world.clone());
    world.spawn(2, "survivor", move || {
        clock.sleep(Duration::from_millis(2500));
        w.kill(1);
        *m2.lock().unwrap() += 1;
    });
    assert_eq!(world.run(Duration::from_secs(60)), Outcome::Finished);
    assert!(
        *dropped.lock().unwrap(),
        "the killed thread's destructors ran"
    );
    assert_eq!(*m.lock().unwrap(), 1);
    assert_eq!(world.now(), Duration::from_millis(2500));
}

#[test]
fn a_wait_nothing_can_end_is_a_stall_and_a_panic_is_reported() {
    let world = Turnstile::new(6);
    let m = Arc::new(Mutex::new(()));
    let cv = Arc::new(Bell::new());
    world.spawn(0, "forgotten", move || {
        let g = m.lock().unwrap();
        let _ = cv.wait(g);
    });
    assert_eq!(
        world.run(Duration::from_secs(60)),
        Outcome::Stalled(vec!["forgotten".into()])
    );

    let world = Turnstile::new(7);
    world.spawn(0, "broken", || panic!("an invariant failed"));
    assert_eq!(
        world.run(Duration::from_secs(1)),
        Outcome::Panicked("broken: an invariant failed".into())
    );
}

#[test]
fn a_thread_blocked_outside_the_simulation_is_reported_not_waited_for() {
    let world = Turnstile::new(8);
    world.set_watchdog(Duration::from_millis(300));
    let std_lock = Arc::new(std::sync::Mutex::new(()));
    let held = std_lock.lock().unwrap();
    let l = std_lock.clone();
    world.spawn(0, "blocked", move || {
        let _g = l.lock().unwrap();
    });
    match world.run(Duration::from_secs(1)) {
        Outcome::Stuck(m) => assert!(m.contains("blocked"), "{m}"),
        other => panic!("{other:?}"),
    }
    drop(held);
}

#[test]
fn a_paused_group_misses_its_timers_and_runs_late() {
    let world = Turnstile::new(9);
    let ticks = Arc::new(Mutex::new(Vec::new()));
    let (clock, t) = (world.clone(), ticks.clone());
    world.spawn(1, "renewer", move || {
        for _ in 0..4 {
            clock.sleep(Duration::from_secs(1));
            t.lock().unwrap().push(clock.now());
        }
    });
    let w = world.clone();
    let clock = world.clone();
    world.spawn(2, "chaos", move || {
        clock.sleep(Duration::from_millis(1500));
        w.pause(1, Duration::from_secs(5));
    });
    assert_eq!(world.run(Duration::from_secs(60)), Outcome::Finished);
    // The tick due at 2 s runs at 6.5 s, when the pause ends; the next ones follow it.
    assert_eq!(
        *ticks.lock().unwrap(),
        [1000, 6500, 7500, 8500].map(Duration::from_millis)
    );
}
