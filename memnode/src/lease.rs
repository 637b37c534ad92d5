//! Lock-holder leases (primary only).
//!
//! A mount session that takes a lock client slot holds a lease from then on, renewed by the
//! mount ([`rackfs_proto::control::ControlRequest::Renew`], every quarter of the lease). A
//! session that has not renewed for the whole lease is *expired*: [`Leases::expire`] moves it to
//! the fenced set, once, and the node then fences it on every memory node and ends the session
//! (which recovers its range locks: see `rackfs_meta::locktree`). A fenced session stays fenced:
//! its requests and renewals are refused with [`ErrorCode::Fenced`] until its connection closes.
//! Leases are timed on the primary's clock; when the primary itself was paused for a while, every
//! lease restarts ([`Leases::restart_all`]) instead of expiring mounts that could not renew.
//!
//! **On the coordinator.** Each held lease is also a lease of the cluster's coordinator (etcd,
//! or the embedded one) with the key `mounts/<session>` under it: granted when the session
//! takes its lock slot, kept alive with each of the mount's renewals, revoked when the session
//! ends or is fenced. So the cluster's live mounts are listed where its nodes are, and a mount
//! is out as soon as the coordinator says its lease lapsed ([`Leases::lapsed_in_coordinator`],
//! checked every eighth of a lease; a renewal that finds it gone is refused as fenced) — or the
//! primary's own timer above runs out, whichever comes first. Renewals go through the primary
//! on purpose: the locks a lease protects are in the primary's memory, so a mount the primary
//! cannot hear from must lose them even if it could still reach etcd.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use rackfs_clock::{Mutex, SharedClock};
use rackfs_coord::{CoordError, Coordinator, Guard, LeaseId, Write};
use tracing::warn;

use rackfs_proto::control::ErrorCode;
use rackfs_proto::Refusal;

/// Default lease of a lock holder.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(4);

#[derive(Default)]
struct State {
    /// Sessions holding a lease, with when it was last renewed (on the primary's clock).
    held: HashMap<u64, Duration>,
    fenced: HashSet<u64>,
    /// The coordinator's lease of each held session.
    in_coordinator: HashMap<u64, LeaseId>,
}

/// The leases of the lock holders (see the module docs).
pub struct Leases {
    lease: Duration,
    state: Mutex<State>,
    coord: Option<Arc<dyn Coordinator>>,
    clock: SharedClock,
}

/// The coordinator key of mount session `session`.
pub fn mount_key(session: u64) -> String {
    format!("mounts/{session}")
}

impl Leases {
    /// Leases timed by the primary alone, on `clock` (unit tests).
    pub fn new(lease: Duration, clock: SharedClock) -> Leases {
        Leases {
            lease,
            state: Mutex::default(),
            coord: None,
            clock,
        }
    }

    /// Leases kept on `coord` too (see the module docs), timed on `clock` (the node's).
    pub fn on(lease: Duration, coord: Arc<dyn Coordinator>, clock: SharedClock) -> Leases {
        Leases {
            coord: Some(coord),
            ..Leases::new(lease, clock)
        }
    }

    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// `session` took a lock slot: its lease starts now (if it has none yet), on the
    /// coordinator too, its key written under the primary's `guard` (a deposed primary's write
    /// does not land: see `crate::term`).
    pub fn hold(&self, session: u64, guard: Option<Guard>) {
        {
            let mut st = self.state.lock().expect("leases lock");
            if st.fenced.contains(&session) || st.held.contains_key(&session) {
                return;
            }
            st.held.insert(session, self.clock.now());
        }
        let Some(c) = &self.coord else { return };
        let granted = c.grant(self.lease).and_then(|(id, _)| {
            let key = Write::Put {
                key: mount_key(session),
                value: format!("{{\"session\":{session}}}").into_bytes(),
                lease: Some(id),
            };
            if let Err(e) = crate::term::write_guarded(&**c, guard.as_ref(), key) {
                let _ = c.revoke(id);
                return Err(e);
            }
            Ok(id)
        });
        match granted {
            Ok(id) => {
                let mut st = self.state.lock().expect("leases lock");
                if st.held.contains_key(&session) {
                    st.in_coordinator.insert(session, id);
                    return;
                }
                drop(st);
                let _ = c.revoke(id); // ended meanwhile
            }
            Err(e) => warn!(
                session,
                coordinator = c.describe(),
                error = %e,
                "no lease with the coordinator for this mount; the primary alone times it"
            ),
        }
    }

    /// The sessions holding a lease.
    pub fn sessions(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self
            .state
            .lock()
            .expect("leases lock")
            .held
            .keys()
            .copied()
            .collect();
        v.sort_unstable();
        v
    }

    /// Ends `session`'s lease with the coordinator (its key goes).
    fn revoke(&self, session: u64) {
        let id = self
            .state
            .lock()
            .expect("leases lock")
            .in_coordinator
            .remove(&session);
        if let (Some(c), Some(id)) = (&self.coord, id) {
            if let Err(e) = c.revoke(id) {
                warn!(session, error = %e, "the mount's lease with the coordinator was not revoked; it lapses by itself");
            }
        }
    }

    /// Held sessions whose lease the coordinator no longer has (their key is gone): from now
    /// on they are fenced. Lists the coordinator's mount keys once, and judges only the
    /// sessions whose key was written before that: a session that took its lease meanwhile
    /// (its key written after the listing was read) is not in it, yet lives.
    pub fn lapsed_in_coordinator(&self) -> Vec<u64> {
        let Some(c) = &self.coord else {
            return Vec::new();
        };
        let written: HashSet<u64> = (self.state.lock().expect("leases lock").in_coordinator)
            .keys()
            .copied()
            .collect();
        let keys = match c.list("mounts/") {
            Ok(keys) => keys,
            Err(e) => {
                warn!(coordinator = c.describe(), error = %e, "cannot list the mounts' leases");
                return Vec::new();
            }
        };
        let live: HashSet<u64> = keys
            .iter()
            .filter_map(|(k, _)| k.rsplit('/').next()?.parse().ok())
            .collect();
        let mut st = self.state.lock().expect("leases lock");
        let gone: Vec<u64> = st
            .in_coordinator
            .keys()
            .filter(|s| written.contains(s) && !live.contains(s))
            .copied()
            .collect();
        for s in &gone {
            st.in_coordinator.remove(s);
            st.held.remove(s);
            st.fenced.insert(*s);
        }
        gone
    }

    /// Renews `session`'s lease (a session without one has nothing to renew), with the
    /// coordinator too; one the coordinator let lapse is fenced.
    pub fn renew(&self, session: u64) -> Result<Duration, Refusal> {
        let id = {
            let mut st = self.state.lock().expect("leases lock");
            if st.fenced.contains(&session) {
                return Err(fenced(session, self.lease));
            }
            if let Some(t) = st.held.get_mut(&session) {
                *t = self.clock.now();
            }
            st.in_coordinator.get(&session).copied()
        };
        if let (Some(c), Some(id)) = (&self.coord, id) {
            match c.keep_alive(id) {
                Ok(_) => {}
                // The lease checks see its key gone and fence it.
                Err(CoordError::Expired(_)) => return Err(fenced(session, self.lease)),
                Err(e) => {
                    warn!(session, error = %e, "cannot renew a mount's lease with the coordinator")
                }
            }
        }
        Ok(self.lease)
    }

    /// The refusal for a request of `session` if it is fenced.
    pub fn check(&self, session: u64) -> Result<(), Refusal> {
        if self
            .state
            .lock()
            .expect("leases lock")
            .fenced
            .contains(&session)
        {
            return Err(fenced(session, self.lease));
        }
        Ok(())
    }

    /// The session ended (its connection closed): it needs no lease any more.
    pub fn end(&self, session: u64) {
        self.revoke(session);
        let mut st = self.state.lock().expect("leases lock");
        st.held.remove(&session);
        st.fenced.remove(&session);
    }

    /// Restarts every lease at `now`: after this node itself was paused (stopped, starved), no
    /// mount could renew, so none is blamed for it.
    pub fn restart_all(&self, now: Duration) {
        for t in self.state.lock().expect("leases lock").held.values_mut() {
            *t = (*t).max(now);
        }
    }

    /// Sessions whose lease ran out by `now`: from now on they are fenced.
    pub fn expire(&self, now: Duration) -> Vec<u64> {
        let mut st = self.state.lock().expect("leases lock");
        let out: Vec<u64> = st
            .held
            .iter()
            .filter(|(_, &t)| now.saturating_sub(t) >= self.lease)
            .map(|(&s, _)| s)
            .collect();
        for s in &out {
            st.held.remove(s);
            st.fenced.insert(*s);
        }
        drop(st);
        for &s in &out {
            self.revoke(s);
        }
        out
    }
}

fn fenced(session: u64, lease: Duration) -> Refusal {
    Refusal::new(
        ErrorCode::Fenced,
        format!(
            "this mount's session {session} did not renew its lock lease within {lease:?} and \
             was fenced: its range locks went to others and nothing it sent is executed any \
             more"
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use rackfs_clock::{Clock, ManualClock};

    /// Leases of `lease` timed on a clock the test moves.
    fn leases(lease: Duration) -> (Leases, Arc<ManualClock>) {
        let clock = Arc::new(ManualClock::default());
        (Leases::new(lease, clock.clone()), clock)
    }

    #[test]
    fn a_lease_expires_once_unless_renewed_and_fences_its_session() {
        let (l, clock) = leases(Duration::from_millis(100));
        l.hold(1, None);
        l.hold(2, None);
        let t0 = clock.now();
        assert!(l.expire(t0).is_empty());
        l.renew(2).unwrap();
        let later = clock.now() + Duration::from_millis(100);
        let mut gone = l.expire(later);
        gone.sort();
        assert_eq!(gone, vec![1, 2]);
        assert!(l.expire(later).is_empty(), "expired once");
        assert_eq!(l.renew(1).unwrap_err().code, ErrorCode::Fenced);
        assert_eq!(l.check(2).unwrap_err().code, ErrorCode::Fenced);
        l.hold(1, None);
        assert!(
            l.expire(later + Duration::from_secs(1)).is_empty(),
            "no new lease"
        );
        assert!(
            l.check(3).is_ok() && l.renew(3).is_ok(),
            "no lease, nothing to fence"
        );
        l.end(1);
        assert!(l.check(1).is_ok());
    }

    #[test]
    fn a_pause_of_the_primary_restarts_every_lease() {
        let (l, clock) = leases(Duration::from_millis(100));
        l.hold(1, None);
        let resumed = clock.now() + Duration::from_secs(5);
        l.restart_all(resumed);
        assert!(l.expire(resumed + Duration::from_millis(99)).is_empty());
        assert_eq!(l.expire(resumed + Duration::from_millis(100)), vec![1]);
    }

    #[test]
    fn a_lease_the_coordinator_let_lapse_fences_its_session() {
        let coord: Arc<dyn Coordinator> =
            Arc::new(rackfs_coord::Local::new(Duration::from_secs(60)));
        let l = Leases::on(
            Duration::from_secs(5),
            coord.clone(),
            Arc::new(ManualClock::default()),
        );
        coord.put("primary", b"p", None).unwrap();
        let term = Some(Guard {
            key: "primary".into(),
            lease: 0,
        });
        l.hold(1, term.clone());
        l.hold(2, term);
        let keys = |c: &Arc<dyn Coordinator>| c.list("mounts/").unwrap().len();
        assert_eq!(keys(&coord), 2, "both mounts are listed on the coordinator");
        assert!(l.lapsed_in_coordinator().is_empty());
        l.renew(1).unwrap();
        // Mount 2's lease goes from the coordinator (lapsed, or revoked by an operator).
        coord.delete(&mount_key(2)).unwrap();
        assert_eq!(l.lapsed_in_coordinator(), vec![2]);
        assert_eq!(l.renew(2).unwrap_err().code, ErrorCode::Fenced);
        assert!(l.renew(1).is_ok());
        // Ending a session revokes its lease: its key goes.
        l.end(1);
        assert_eq!(keys(&coord), 0);
        // A deposed primary (its guard no longer holds) writes no mount's key.
        let deposed = Some(Guard {
            key: "primary".into(),
            lease: 99,
        });
        l.hold(3, deposed);
        assert_eq!(keys(&coord), 0, "a deposed primary wrote a mount's key");
    }

    /// A coordinator whose listing of the mounts' keys is read before `meanwhile` runs (a
    /// session taking its lease while the list is in flight).
    struct ListedBefore {
        inner: rackfs_coord::Local,
        meanwhile: std::sync::Mutex<Option<Box<dyn FnOnce() + Send>>>,
    }

    impl Coordinator for ListedBefore {
        fn grant(&self, ttl: Duration) -> Result<(LeaseId, Duration), CoordError> {
            self.inner.grant(ttl)
        }
        fn keep_alive(&self, lease: LeaseId) -> Result<Duration, CoordError> {
            self.inner.keep_alive(lease)
        }
        fn revoke(&self, lease: LeaseId) -> Result<(), CoordError> {
            self.inner.revoke(lease)
        }
        fn put(&self, key: &str, value: &[u8], lease: Option<LeaseId>) -> Result<(), CoordError> {
            self.inner.put(key, value, lease)
        }
        fn create(
            &self,
            key: &str,
            value: &[u8],
            lease: Option<LeaseId>,
        ) -> Result<Result<u64, Vec<u8>>, CoordError> {
            self.inner.create(key, value, lease)
        }
        fn get(&self, key: &str) -> Result<Option<Vec<u8>>, CoordError> {
            self.inner.get(key)
        }
        fn created(&self, key: &str) -> Result<Option<(u64, Vec<u8>)>, CoordError> {
            self.inner.created(key)
        }
        fn write_if(&self, guard: &Guard, write: Write) -> Result<(), CoordError> {
            self.inner.write_if(guard, write)
        }
        fn holds(&self, guard: &Guard) -> Result<bool, CoordError> {
            self.inner.holds(guard)
        }
        fn list(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, CoordError> {
            let listed = self.inner.list(prefix);
            let meanwhile = self.meanwhile.lock().unwrap().take();
            if let Some(f) = meanwhile {
                f();
            }
            listed
        }
        fn delete(&self, key: &str) -> Result<(), CoordError> {
            self.inner.delete(key)
        }
        fn describe(&self) -> String {
            "listed before".into()
        }
    }

    /// Chaos on etcd: a mount's new session, its key written while the primary's look at the
    /// mounts' keys was in flight, was fenced 8 ms after it began (its next write failed).
    #[test]
    fn a_session_whose_key_is_written_while_the_keys_are_listed_is_not_fenced() {
        let coord = Arc::new(ListedBefore {
            inner: rackfs_coord::Local::new(Duration::from_secs(60)),
            meanwhile: Default::default(),
        });
        let l = Arc::new(Leases::on(
            Duration::from_secs(5),
            coord.clone(),
            Arc::new(ManualClock::default()),
        ));
        coord.put("primary", b"p", None).unwrap();
        let term = Guard {
            key: "primary".into(),
            lease: 0,
        };
        l.hold(1, Some(term.clone()));
        let l2 = l.clone();
        *coord.meanwhile.lock().unwrap() = Some(Box::new(move || l2.hold(2, Some(term))));
        assert!(
            l.lapsed_in_coordinator().is_empty(),
            "a session fenced as it began"
        );
        assert!(l.renew(2).is_ok());
        assert_eq!(coord.list("mounts/").unwrap().len(), 2);
        // Its key gone for good, the next look fences it.
        coord.delete(&mount_key(2)).unwrap();
        assert_eq!(l.lapsed_in_coordinator(), vec![2]);
    }

    #[test]
    fn renewal_keeps_a_lease() {
        let (l, clock) = leases(Duration::from_millis(200));
        l.hold(7, None);
        clock.sleep(Duration::from_millis(120));
        l.renew(7).unwrap();
        assert!(l
            .expire(clock.now() + Duration::from_millis(150))
            .is_empty());
        assert_eq!(l.expire(clock.now() + Duration::from_millis(200)), vec![7]);
    }
}
