//! [`Bell`]: a condition variable for a [`crate::Mutex`] that a simulation can see, so
//! code that waits for another thread's news (a queue filling, a shipment answered, a fence
//! ending) runs unchanged on OS threads and under the [`crate::Turnstile`].
//!
//! On an OS thread it is a `Condvar`. On a simulated thread a wait gives the turn back until
//! a ring or the timeout (virtual), then takes the mutex again as a simulated thread does.
//!
//! Invariant: no ring is lost between a simulated waiter's unlock and its wait, because no
//! other simulated thread runs in between (the waiter holds the turn). A ring from a thread
//! outside the simulation (the test driving it) wakes only OS waiters.

use std::sync::Condvar;
use std::time::Duration;

use crate::mutex::MutexGuard;
use crate::turnstile::{new_gate, Here};

/// A condition variable that a simulation sees (see the module docs).
pub struct Bell {
    cv: Condvar,
    /// Where simulated waiters wait.
    gate: u64,
}

impl Default for Bell {
    fn default() -> Bell {
        Bell::new()
    }
}

impl std::fmt::Debug for Bell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bell").field("gate", &self.gate).finish()
    }
}

impl Bell {
    pub fn new() -> Bell {
        Bell {
            cv: Condvar::new(),
            gate: new_gate(),
        }
    }

    /// Unlocks `guard`, waits for a ring, and locks again. May wake spuriously, as any
    /// condition variable: callers check their condition in a loop.
    pub fn wait<'a, T>(&self, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
        match Here::now() {
            None => {
                let (mutex, g) = guard.into_std();
                let g = self.cv.wait(g).unwrap_or_else(|p| p.into_inner());
                MutexGuard::from_std(mutex, g)
            }
            Some(here) => {
                let mutex = guard.mutex();
                drop(guard);
                here.wait_at(self.gate, None);
                mutex.lock().unwrap_or_else(|p| p.into_inner())
            }
        }
    }

    /// [`Bell::wait`] for at most `timeout` (of the world's time on a simulated thread);
    /// `true` if it timed out.
    pub fn wait_timeout<'a, T>(
        &self,
        guard: MutexGuard<'a, T>,
        timeout: Duration,
    ) -> (MutexGuard<'a, T>, bool) {
        match Here::now() {
            None => {
                let (mutex, g) = guard.into_std();
                let (g, t) = self
                    .cv
                    .wait_timeout(g, timeout)
                    .unwrap_or_else(|p| p.into_inner());
                (MutexGuard::from_std(mutex, g), t.timed_out())
            }
            Some(here) => {
                let until = here.time() + timeout;
                let mutex = guard.mutex();
                drop(guard);
                here.wait_at(self.gate, Some(until));
                let timed_out = here.time() >= until;
                (mutex.lock().unwrap_or_else(|p| p.into_inner()), timed_out)
            }
        }
    }

    /// Wakes every waiter.
    pub fn notify_all(&self) {
        self.cv.notify_all();
        if let Some(here) = Here::now() {
            here.open(self.gate);
        }
    }

    /// Wakes a waiter (under simulation, every one: they recheck their condition).
    pub fn notify_one(&self) {
        self.cv.notify_one();
        if let Some(here) = Here::now() {
            here.open(self.gate);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Mutex;
    use crate::{Clock, Turnstile};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    #[test]
    fn on_os_threads_a_ring_wakes_a_waiter() {
        let m = Arc::new((Mutex::new(false), Bell::new()));
        let m2 = m.clone();
        let t = std::thread::spawn(move || {
            *m2.0.lock().unwrap() = true;
            m2.1.notify_all();
        });
        let mut g = m.0.lock().unwrap();
        while !*g {
            g = m.1.wait_timeout(g, Duration::from_secs(5)).0;
        }
        t.join().unwrap();
    }

    #[test]
    fn in_a_world_a_ring_wakes_a_waiter_and_a_silent_bell_times_out_on_virtual_time() {
        let world = Turnstile::new(7);
        let shared = Arc::new((Mutex::new(0u32), Bell::new()));
        let woke_at = Arc::new(Mutex::new(None));
        let timed_out = Arc::new(AtomicBool::new(false));
        let (s, w, c) = (shared.clone(), woke_at.clone(), world.clone());
        world.spawn(0, "waiter", move || {
            let mut g = s.0.lock().unwrap();
            while *g == 0 {
                g = s.1.wait(g);
            }
            *w.lock().unwrap() = Some(c.now());
        });
        let (s, c) = (shared.clone(), world.clone());
        world.spawn(0, "ringer", move || {
            c.sleep(Duration::from_millis(30));
            *s.0.lock().unwrap() = 1;
            s.1.notify_one();
        });
        let (s, t) = (Arc::new((Mutex::new(()), Bell::new())), timed_out.clone());
        world.spawn(1, "alone", move || {
            let g = s.0.lock().unwrap();
            let (_g, out) = s.1.wait_timeout(g, Duration::from_secs(3600));
            t.store(out, Ordering::SeqCst);
        });
        let outcome = world.run(Duration::from_secs(7200));
        assert_eq!(outcome, crate::turnstile::Outcome::Finished);
        assert_eq!(*woke_at.lock().unwrap(), Some(Duration::from_millis(30)));
        assert!(timed_out.load(Ordering::SeqCst), "an hour passed unrung");
        assert!(world.now() >= Duration::from_secs(3600));
    }

    #[test]
    fn in_a_world_a_waiter_retakes_a_mutex_another_holds_asleep() {
        let world = Turnstile::new(3);
        let shared = Arc::new((Mutex::new(0u32), Bell::new()));
        let (s, c) = (shared.clone(), world.clone());
        world.spawn(0, "waiter", move || {
            let mut g = s.0.lock().unwrap();
            while *g == 0 {
                g = s.1.wait(g);
            }
            *g += 10;
        });
        let (s, c2) = (shared.clone(), c);
        world.spawn(0, "holder", move || {
            // The waiter (runnable at time 0) waits first.
            c2.sleep(Duration::from_millis(1));
            let mut g = s.0.lock().unwrap();
            *g = 1;
            s.1.notify_all();
            // Asleep holding the mutex: the waiter must let it run rather than block.
            c2.sleep(Duration::from_millis(5));
            *g += 1;
        });
        assert_eq!(
            world.run(Duration::from_secs(1)),
            crate::turnstile::Outcome::Finished
        );
        assert_eq!(*shared.0.lock().unwrap(), 12);
    }
}
