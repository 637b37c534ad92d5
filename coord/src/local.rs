//! The embedded coordinator: in the primary's process, for clusters without etcd. It keeps the
//! same semantics as etcd but lives and dies with the primary. When its process was paused
//! (nobody could renew meanwhile), every lease restarts instead of lapsing, as etcd extends
//! leases when its leader changes.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Time as the coordinator reads it: since a fixed start.
pub type Clock = Box<dyn Fn() -> Duration + Send + Sync>;

use crate::{CoordError, Coordinator, LeaseId};

#[derive(Default)]
struct State {
    keys: BTreeMap<String, (Vec<u8>, Option<LeaseId>)>,
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
        self.keys.retain(|_, (_, l)| *l != Some(id));
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
    clock: Clock,
}

impl Local {
    /// `pause`: a gap between two calls longer than this means the process was paused (its
    /// owner calls at least that often).
    pub fn new(pause: Duration) -> Local {
        let start = Instant::now();
        Local::with_clock(pause, Box::new(move || start.elapsed()))
    }

    /// [`Local::new`] on a clock of the caller's (a simulation's).
    pub fn with_clock(pause: Duration, clock: Clock) -> Local {
        Local {
            state: Mutex::default(),
            pause,
            clock,
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        let mut s = self.state.lock().expect("coordinator lock");
        let now = (self.clock)();
        if let Some(gap) = s.last.map(|l| now - l).filter(|&g| g > self.pause) {
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
        let now = (self.clock)();
        let mut s = self.state();
        s.next += 1;
        let id = s.next;
        s.leases.insert(id, (ttl, now + ttl));
        Ok((id, ttl))
    }

    fn keep_alive(&self, lease: LeaseId) -> Result<Duration, CoordError> {
        let now = (self.clock)();
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
        s.keys.insert(key.into(), (value.to_vec(), lease));
        Ok(())
    }

    fn create(
        &self,
        key: &str,
        value: &[u8],
        lease: Option<LeaseId>,
    ) -> Result<Result<(), Vec<u8>>, CoordError> {
        let mut s = self.state();
        s.check(lease)?;
        if let Some((v, _)) = s.keys.get(key) {
            return Ok(Err(v.clone()));
        }
        s.keys.insert(key.into(), (value.to_vec(), lease));
        Ok(Ok(()))
    }

    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, CoordError> {
        Ok(self.state().keys.get(key).map(|(v, _)| v.clone()))
    }

    fn list(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, CoordError> {
        Ok(self
            .state()
            .keys
            .range(prefix.to_string()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, (v, _))| (k.clone(), v.clone()))
            .collect())
    }

    fn delete(&self, key: &str) -> Result<(), CoordError> {
        self.state().keys.remove(key);
        Ok(())
    }

    fn describe(&self) -> String {
        "embedded (in the primary)".into()
    }
}
