//! [`Mutex`]: `std::sync::Mutex` with the same API, whose contention a simulation sees, so
//! code that holds a lock across a wait (a control call under the metadata lock) runs
//! unchanged under the [`crate::Turnstile`].
//!
//! On an OS thread it is the std mutex: an uncontended lock is one `try_lock`, a contended one
//! blocks as std does. On a simulated thread, finding it held gives the turn back until the
//! holder unlocks it (a std lock would block the OS thread holding the turn, and with it the
//! whole world, while the holder waits to be given the turn).
//!
//! A simulated process killed while a thread of its held the lock (it unwinds) leaves it
//! unpoisoned.
//!
//! In debug builds (the tests) a thread that locks a mutex it already holds panics instead of
//! waiting for itself for good: a primary's membership thread once did so, and every later
//! declaration of a dead node waited behind it.
//!
//! Invariant: a simulated thread waits only after flagging `contended`, and an unlock that
//! finds the flag opens the gate, so no unlock is missed (between the waiter's failed
//! `try_lock` and its wait no other simulated thread runs).

use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{LockResult, PoisonError, TryLockError};

use crate::turnstile::{new_gate, Here};

/// A mutex a simulation sees (see the module docs).
pub struct Mutex<T: ?Sized> {
    /// Where simulated threads wait for it.
    gate: u64,
    /// A simulated thread waits for it: the unlock opens the gate.
    contended: AtomicBool,
    /// The thread holding it ([`this_thread`]; 0: none), checked in debug builds only.
    owner: AtomicU64,
    inner: std::sync::Mutex<T>,
}

/// A number of the calling thread's own, never 0.
fn this_thread() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local! {
        static ID: u64 = NEXT.fetch_add(1, Ordering::Relaxed);
    }
    ID.with(|id| *id)
}

/// [`Mutex`]'s guard.
pub struct MutexGuard<'a, T: ?Sized> {
    mutex: &'a Mutex<T>,
    /// Always `Some` but while being dropped or handed to a `Condvar`.
    guard: Option<std::sync::MutexGuard<'a, T>>,
}

impl<T> Mutex<T> {
    pub fn new(value: T) -> Mutex<T> {
        Mutex {
            gate: new_gate(),
            contended: AtomicBool::new(false),
            owner: AtomicU64::new(0),
            inner: std::sync::Mutex::new(value),
        }
    }

    pub fn into_inner(self) -> LockResult<T> {
        self.inner.into_inner()
    }
}

impl<T: Default> Default for Mutex<T> {
    fn default() -> Mutex<T> {
        Mutex::new(T::default())
    }
}

impl<T: ?Sized + std::fmt::Debug> std::fmt::Debug for Mutex<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.inner.fmt(f)
    }
}

impl<T: ?Sized> Mutex<T> {
    /// No thread holds it any more (the debug builds' re-entry check).
    fn disown(&self) {
        if cfg!(debug_assertions) {
            self.owner.store(0, Ordering::Relaxed);
        }
    }

    fn guard<'a>(&'a self, g: std::sync::MutexGuard<'a, T>) -> MutexGuard<'a, T> {
        if cfg!(debug_assertions) {
            self.owner.store(this_thread(), Ordering::Relaxed);
        }
        MutexGuard {
            mutex: self,
            guard: Some(g),
        }
    }

    fn wrap<'a>(
        &'a self,
        r: LockResult<std::sync::MutexGuard<'a, T>>,
    ) -> LockResult<MutexGuard<'a, T>> {
        match r {
            Ok(g) => Ok(self.guard(g)),
            Err(p) => Err(PoisonError::new(self.guard(p.into_inner()))),
        }
    }

    /// Locks it (see the module docs for how a simulated thread waits).
    pub fn lock(&self) -> LockResult<MutexGuard<'_, T>> {
        if cfg!(debug_assertions) && self.owner.load(Ordering::Relaxed) == this_thread() {
            panic!("a thread locks a mutex it already holds: it would wait for itself for good");
        }
        loop {
            match self.inner.try_lock() {
                Ok(g) => return Ok(self.guard(g)),
                Err(TryLockError::Poisoned(p)) => {
                    return Err(PoisonError::new(self.guard(p.into_inner())))
                }
                Err(TryLockError::WouldBlock) => match Here::now() {
                    None => return self.wrap(self.inner.lock()),
                    Some(here) => {
                        self.contended.store(true, Ordering::SeqCst);
                        here.wait_at(self.gate, None);
                    }
                },
            }
        }
    }
}

impl<'a, T: ?Sized> MutexGuard<'a, T> {
    /// The std guard, for a `Condvar` wait; the caller gives it back with [`MutexGuard::from_std`].
    pub(crate) fn into_std(mut self) -> (&'a Mutex<T>, std::sync::MutexGuard<'a, T>) {
        self.mutex.disown();
        let g = self.guard.take().expect("held");
        (self.mutex, g)
    }

    pub(crate) fn from_std(mutex: &'a Mutex<T>, g: std::sync::MutexGuard<'a, T>) -> Self {
        mutex.guard(g)
    }

    /// The mutex this guard holds.
    pub(crate) fn mutex(&self) -> &'a Mutex<T> {
        self.mutex
    }
}

impl<T: ?Sized> Deref for MutexGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.guard.as_ref().expect("held")
    }
}

impl<T: ?Sized> DerefMut for MutexGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        self.guard.as_mut().expect("held")
    }
}

impl<T: ?Sized> Drop for MutexGuard<'_, T> {
    fn drop(&mut self) {
        let Some(g) = self.guard.take() else {
            return; // handed to a Condvar: still locked
        };
        self.mutex.disown();
        drop(g);
        if std::thread::panicking() && Here::now().is_some_and(|h| h.killed()) {
            // A killed process's thread unwinding is no bug in the critical section: what
            // it shared is another process's to go on with (or nobody's).
            self.mutex.inner.clear_poison();
        }
        // Read first: an unlock nobody simulated waits for writes nothing shared.
        if self.mutex.contended.load(Ordering::Relaxed)
            && self.mutex.contended.swap(false, Ordering::SeqCst)
        {
            if let Some(here) = Here::now() {
                here.open(self.mutex.gate);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::turnstile::Outcome;
    use crate::{Clock, Turnstile};
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn on_os_threads_it_is_a_mutex() {
        let m = Arc::new(Mutex::new(0u64));
        let ts: Vec<_> = (0..4)
            .map(|_| {
                let m = m.clone();
                std::thread::spawn(move || {
                    for _ in 0..1000 {
                        *m.lock().unwrap() += 1;
                    }
                })
            })
            .collect();
        ts.into_iter().for_each(|t| t.join().unwrap());
        assert_eq!(*m.lock().unwrap(), 4000);
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "a thread locks a mutex it already holds")]
    fn a_thread_locking_a_mutex_it_holds_panics_instead_of_waiting_for_itself() {
        let m = Mutex::new(0u64);
        let _held = m.lock().unwrap();
        let _again = m.lock();
    }

    #[test]
    fn a_mutex_unlocked_or_held_by_another_thread_is_no_reentry() {
        let m = Arc::new(Mutex::new(0u64));
        drop(m.lock().unwrap());
        let held = m.lock().unwrap();
        let other = {
            let m = m.clone();
            std::thread::spawn(move || *m.lock().unwrap() += 1)
        };
        std::thread::sleep(Duration::from_millis(20));
        drop(held);
        other.join().unwrap();
        assert_eq!(*m.lock().unwrap(), 1);
    }

    #[test]
    fn in_a_world_a_thread_waits_for_a_holder_asleep_without_blocking_the_world() {
        for seed in 0..20 {
            let world = Turnstile::new(seed);
            let m = Arc::new(Mutex::new(Vec::new()));
            for i in 0..3u32 {
                let (m, w) = (m.clone(), world.clone());
                world.spawn(0, &format!("t{i}"), move || {
                    let mut g = m.lock().unwrap();
                    g.push((i, w.now()));
                    // Asleep holding it: the others must wait without blocking the world.
                    w.sleep(Duration::from_millis(10));
                    g.push((i, w.now()));
                });
            }
            assert_eq!(world.run(Duration::from_secs(1)), Outcome::Finished);
            let seen = m.lock().unwrap().clone();
            assert_eq!(seen.len(), 6, "seed {seed}: {seen:?}");
            for pair in seen.chunks(2) {
                assert_eq!(pair[0].0, pair[1].0, "seed {seed}: held across the sleep");
            }
            assert_eq!(world.now(), Duration::from_millis(30), "seed {seed}");
        }
    }
}
