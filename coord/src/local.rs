//! The embedded coordinator: in the primary's process, for clusters without etcd. It keeps the
//! same semantics as etcd but lives and dies with the primary. When its process was paused
//! (nobody could renew meanwhile), every lease restarts instead of lapsing, as etcd extends
//! leases when its leader changes. Its leases are timed on a [`SharedClock`] handed in: the
//! host's ([`Local::new`]), or a simulation's ([`Local::with_clock`]).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rackfs_clock::{SharedClock, SystemClock};

use crate::{CoordError, Coordinator, Guard, LeaseId, Write};

/// A key's value, the lease it was put under, and the revision it was created at.
struct Key {
    value: Vec<u8>,
    lease: Option<LeaseId>,
    created: u64,
}

#[derive(Default)]
struct State {
    keys: BTreeMap<String, Key>,
    /// Grows with every write (etcd's revision).
    revision: u64,
    /// Live leases: ttl and deadline.
    leases: HashMap<LeaseId, (Duration, Duration)>,
    next: LeaseId,
    /// When the last call came, to notice a pause of the process.
    last: Option<Duration>,
}

impl State {
    /// Drops lapsed leases and their keys.
    fn expire(&mut self, now: Duration) {
        let lapsed: Vec<LeaseId> = self
            .leases
            .iter()
            .filter(|(_, (_, until))| *until <= now)
            .map(|(&id, _)| id)
            .collect();
        for id in lapsed {
            self.end(id);
        }
    }

    fn end(&mut self, id: LeaseId) {
        self.leases.remove(&id);
        let before = self.keys.len();
        self.keys.retain(|_, k| k.lease != Some(id));
        if self.keys.len() != before {
            self.revision += 1;
        }
    }

    /// Puts `key` (a new revision; its creation revision kept if it exists).
    fn put(&mut self, key: &str, value: &[u8], lease: Option<LeaseId>) -> u64 {
        self.revision += 1;
        let created = self.keys.get(key).map_or(self.revision, |k| k.created);
        self.keys.insert(
            key.into(),
            Key {
                value: value.to_vec(),
                lease,
                created,
            },
        );
        self.revision
    }

    fn delete(&mut self, key: &str) {
        if self.keys.remove(key).is_some() {
            self.revision += 1;
        }
    }

    fn holds(&self, guard: &Guard) -> bool {
        self.keys
            .get(&guard.key)
            .is_some_and(|k| k.lease.unwrap_or(0) == guard.lease)
    }

    fn check(&self, lease: Option<LeaseId>) -> Result<(), CoordError> {
        match lease {
            Some(id) if !self.leases.contains_key(&id) => Err(CoordError::Expired(id)),
            _ => Ok(()),
        }
    }
}

/// An in-process [`Coordinator`].
pub struct Local {
    state: Mutex<State>,
    pause: Duration,
    clock: SharedClock,
}

impl Local {
    /// `pause`: a gap between two calls longer than this means the process was paused (its
    /// owner calls at least that often).
    pub fn new(pause: Duration) -> Local {
        Local::with_clock(pause, Arc::new(SystemClock::new()))
    }

    /// [`Local::new`] on a clock of the caller's (a memory node's, a simulation's).
    pub fn with_clock(pause: Duration, clock: SharedClock) -> Local {
        Local {
            state: Mutex::default(),
            pause,
            clock,
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        let mut s = self.state.lock().expect("coordinator lock");
        let now = self.clock.now();
        if let Some(gap) = s
            .last
            .map(|l| now.saturating_sub(l))
            .filter(|&g| g > self.pause)
        {
            tracing::info!(paused = ?gap, "the embedded coordinator was paused: every lease restarts");
            for (ttl, until) in s.leases.values_mut() {
                *until = now + *ttl;
            }
        }
        s.last = Some(now);
        s.expire(now);
        s
    }
}

impl Coordinator for Local {
    fn grant(&self, ttl: Duration) -> Result<(LeaseId, Duration), CoordError> {
        let now = self.clock.now();
        let mut s = self.state();
        s.next += 1;
        let id = s.next;
        s.leases.insert(id, (ttl, now + ttl));
        Ok((id, ttl))
    }

    fn keep_alive(&self, lease: LeaseId) -> Result<Duration, CoordError> {
        let now = self.clock.now();
        let mut s = self.state();
        let (ttl, until) = s.leases.get_mut(&lease).ok_or(CoordError::Expired(lease))?;
        *until = now + *ttl;
        Ok(*ttl)
    }

    fn revoke(&self, lease: LeaseId) -> Result<(), CoordError> {
        self.state().end(lease);
        Ok(())
    }

    fn put(&self, key: &str, value: &[u8], lease: Option<LeaseId>) -> Result<(), CoordError> {
        let mut s = self.state();
        s.check(lease)?;
        s.put(key, value, lease);
        Ok(())
    }

    fn create(
        &self,
        key: &str,
        value: &[u8],
        lease: Option<LeaseId>,
    ) -> Result<Result<u64, Vec<u8>>, CoordError> {
        let mut s = self.state();
        s.check(lease)?;
        if let Some(k) = s.keys.get(key) {
            return Ok(Err(k.value.clone()));
        }
        Ok(Ok(s.put(key, value, lease)))
    }

    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, CoordError> {
        Ok(self.state().keys.get(key).map(|k| k.value.clone()))
    }

    fn created(&self, key: &str) -> Result<Option<(u64, Vec<u8>)>, CoordError> {
        Ok(self
            .state()
            .keys
            .get(key)
            .map(|k| (k.created, k.value.clone())))
    }

    fn write_if(&self, guard: &Guard, write: Write) -> Result<(), CoordError> {
        let mut s = self.state();
        if !s.holds(guard) {
            return Err(CoordError::NotHeld {
                key: guard.key.clone(),
                lease: guard.lease,
            });
        }
        match write {
            Write::Put { key, value, lease } => {
                s.check(lease)?;
                s.put(&key, &value, lease);
            }
            Write::Delete { key } => s.delete(&key),
        }
        Ok(())
    }

    fn holds(&self, guard: &Guard) -> Result<bool, CoordError> {
        Ok(self.state().holds(guard))
    }

    fn list(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, CoordError> {
        Ok(self
            .state()
            .keys
            .range(prefix.to_string()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, v)| (k.clone(), v.value.clone()))
            .collect())
    }

    fn delete(&self, key: &str) -> Result<(), CoordError> {
        self.state().delete(key);
        Ok(())
    }

    fn describe(&self) -> String {
        "embedded (in the primary)".into()
    }
}
