//! The primary's election: a primary holds the coordinator's `primary` key under a lease of
//! its own, for as long as it acts. Created only if absent, the key admits one primary per
//! cluster; a primary starting while an earlier one's key lives waits out that lease (a killed
//! primary's lease lapses by itself). With etcd the primary serves data and metadata only while
//! its lease holds, timed from each renewal's sending ([`rackfs_coord::Held`]), so it stops
//! before etcd lets anyone else take the key: no two primaries ever act at once. Once its lease
//! lapsed it campaigns again, and exits if another node won. The embedded coordinator lives in
//! the primary itself, so there it simply holds.
//!
//! Every primary, once elected and before it acts, records itself and its epoch under
//! [`LAST_PRIMARY_KEY`] (guarded by its key's lease). A primary elected again after its lease
//! lapsed serves only if that key still names its own last term: else another node was
//! primary meanwhile and answered changes this one lacks (that one's lease may have lapsed
//! too, leaving the key free), and it exits.

use std::sync::Arc;
use std::time::Duration;

use rackfs_clock::Clock;
use rackfs_coord::{
    claim, renew, renew_every, Claimed, CoordError, Coordinator, Guard, Held, LeaseId, Write,
};
use tracing::{error, info, warn};

use crate::coordinator::{members, parse_primary, parse_standby};
use crate::node::Node;
use crate::term::PRIMARY_KEY;

/// Why a primary could not take the cluster.
#[derive(Debug, thiserror::Error)]
pub enum ElectionError {
    #[error("another primary holds cluster {cluster}: {holder}")]
    Held { cluster: String, holder: String },
    #[error("the coordinator: {0}")]
    Coordinator(#[from] CoordError),
}

/// Why a node started as the primary (`--primary`) joins its cluster as a data node instead
/// of campaigning, if it should: the cluster lives without it, with another node elected, or
/// with a standby of another node that holds the namespace and takes over once this node's
/// earlier run's key lapses (an empty namespace must never win that race). A unit's command
/// line is fixed, so a primary restarted after a failover comes back this way; only a cluster
/// with neither starts from a `--primary`.
pub fn joins_instead(coord: &dyn Coordinator, me: u32) -> Result<Option<String>, CoordError> {
    if let Some(v) = coord.get(PRIMARY_KEY)? {
        match parse_primary(&v) {
            Some((id, tcp, _)) if id != me => {
                return Ok(Some(format!("node {id} at {tcp} is the elected primary")));
            }
            _ => {}
        }
    }
    let Some(standby) = coord.get("standby")?.as_deref().and_then(parse_standby) else {
        return Ok(None);
    };
    let live = members(coord)?.iter().any(|&(id, _)| id == standby);
    Ok((standby != me && live)
        .then(|| format!("node {standby} is the metadata standby and takes over the namespace")))
}

/// The last node elected primary, with its epoch (see the module docs).
pub const LAST_PRIMARY_KEY: &str = "last_primary";

/// [`LAST_PRIMARY_KEY`]'s value for the primary whose key holds `me`, elected at `epoch`.
fn last_primary(me: &[u8], epoch: u64) -> Vec<u8> {
    let mut v = format!("{epoch} ").into_bytes();
    v.extend_from_slice(me);
    v
}

/// Records the primary `me` elected as `won` under [`LAST_PRIMARY_KEY`], guarded by its key;
/// on failure gives the key up (nothing was served under it).
fn record(coord: &dyn Coordinator, me: &[u8], won: &Claimed) -> Result<(), CoordError> {
    let guard = Guard {
        key: PRIMARY_KEY.into(),
        lease: won.held.lease,
    };
    let put = Write::Put {
        key: LAST_PRIMARY_KEY.into(),
        value: last_primary(me, won.epoch),
        lease: None,
    };
    coord.write_if(&guard, put).inspect_err(|_| {
        let _ = coord.revoke(won.held.lease);
    })
}

/// A primary's hold on its cluster.
pub struct Primacy {
    coord: Arc<dyn Coordinator>,
    me: Vec<u8>,
    ttl: Duration,
    held: Held,
    /// The election's epoch: the revision the key was created at.
    epoch: u64,
}

impl Primacy {
    /// Takes the `primary` key for `me` (its value) under a lease of `ttl`, waiting out an earlier
    /// holder's lease for up to twice `ttl` (plus a second); the lease is timed on `clock`
    /// (the node's).
    pub fn campaign(
        coord: Arc<dyn Coordinator>,
        me: Vec<u8>,
        ttl: Duration,
        cluster: &str,
        clock: &dyn Clock,
    ) -> Result<Primacy, ElectionError> {
        let give_up = clock.now() + 2 * ttl + Duration::from_secs(1);
        let mut told = false;
        loop {
            let claimed = match claim(&*coord, PRIMARY_KEY, &me, ttl, clock.now()) {
                Ok(Ok(won)) => record(&*coord, &me, &won).map(|()| Ok(won)),
                other => other,
            };
            match claimed {
                Ok(Ok(won)) => {
                    info!(coordinator = %coord.describe(), lease = won.held.lease, epoch = won.epoch, "elected primary of the cluster");
                    return Ok(Primacy {
                        coord,
                        me,
                        ttl,
                        held: won.held,
                        epoch: won.epoch,
                    });
                }
                Ok(Err(holder)) => {
                    let holder = String::from_utf8_lossy(&holder).to_string();
                    if clock.now() > give_up {
                        return Err(ElectionError::Held {
                            cluster: cluster.into(),
                            holder,
                        });
                    }
                    if !std::mem::replace(&mut told, true) {
                        info!(%holder, "the cluster has a primary's key: waiting for its lease to lapse");
                    }
                }
                // A coordinator that answers slowly or not yet: try again until giving up.
                Err(e) if clock.now() > give_up => return Err(e.into()),
                Err(e) => {
                    warn!(coordinator = %coord.describe(), error = %e, "cannot campaign for primary yet; retrying")
                }
            }
            clock.sleep(Duration::from_millis(200));
        }
    }

    /// The lease the primary's key is held under.
    pub fn lease(&self) -> LeaseId {
        self.held.lease
    }

    /// The election's epoch (see [`crate::term`]).
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The guard of this primary's coordinator writes.
    pub fn guard(&self) -> Guard {
        Guard {
            key: PRIMARY_KEY.into(),
            lease: self.held.lease,
        }
    }

    /// Until when the primary may act, on the clock it campaigned on (the node's).
    pub fn until(&self) -> Duration {
        self.held.until()
    }

    /// Renews the primary's lease while the node runs, extending its serve lease with each
    /// renewal. Once the lease lapsed (the coordinator was out of reach for a whole lease) the
    /// node serves nothing and campaigns again: it resumes if the key is still free and exits
    /// if another node took it.
    pub fn run(mut self, node: &Arc<Node>) {
        let mut complained = false;
        while !node.is_stopping() {
            node.clock.sleep(renew_every(self.ttl));
            match renew(&*self.coord, &mut self.held, node.clock.now()) {
                Ok(()) => {
                    self.serve(node);
                    if std::mem::replace(&mut complained, false) {
                        info!("the primary's lease is renewed again");
                    }
                }
                Err(CoordError::Expired(_)) => {
                    warn!(coordinator = %self.coord.describe(), "this primary's lease lapsed: it serves nothing until it is elected again");
                    node.lease_words.lapsed();
                    self.again(node);
                }
                Err(e) => {
                    if !std::mem::replace(&mut complained, true) {
                        warn!(coordinator = %self.coord.describe(), error = %e, "cannot renew the primary's lease; it stops serving when the lease lapses");
                    }
                }
            }
        }
    }

    /// Gives the key up at once (a node elected but unable to serve).
    pub fn resign(self) {
        if let Err(e) = self.coord.revoke(self.held.lease) {
            warn!(error = %e, "cannot revoke the primary's lease; it lapses by itself");
        }
    }

    fn serve(&self, node: &Node) {
        node.serve.extend_to(node.lease_ns(self.until()));
        node.lease_words.publish(node.serve.until());
    }

    /// Campaigns again after the lease lapsed.
    fn again(&mut self, node: &Arc<Node>) {
        while !node.is_stopping() {
            match claim(
                &*self.coord,
                PRIMARY_KEY,
                &self.me,
                self.ttl,
                node.clock.now(),
            ) {
                Ok(Ok(won)) => {
                    // Serves again only if nobody was primary meanwhile.
                    let last = self.coord.get(LAST_PRIMARY_KEY);
                    if let Ok(Some(v)) = &last {
                        if *v != last_primary(&self.me, self.epoch) {
                            let _ = self.coord.revoke(won.held.lease);
                            error!(
                                last = %String::from_utf8_lossy(v),
                                "another node was primary while this one's lease was lapsed: this one exits"
                            );
                            (node.exit)(3);
                            unreachable!("the node's process ended");
                        }
                    }
                    if last.is_err() || record(&*self.coord, &self.me, &won).is_err() {
                        let _ = self.coord.revoke(won.held.lease);
                        node.clock.sleep(Duration::from_millis(200));
                        continue;
                    }
                    info!(
                        lease = won.held.lease,
                        epoch = won.epoch,
                        "elected primary again: serving"
                    );
                    self.held = won.held;
                    self.epoch = won.epoch;
                    node.term.begin(self.held.lease, self.epoch);
                    node.declare_term();
                    self.serve(node);
                    return;
                }
                // Its own key from the lapsed lease, not yet reaped by the coordinator.
                Ok(Err(holder)) if holder == self.me => {
                    node.clock.sleep(Duration::from_millis(200))
                }
                Ok(Err(holder)) => {
                    error!(holder = %String::from_utf8_lossy(&holder), "another node is primary now: this one exits");
                    (node.exit)(3);
                    unreachable!("the node's process ended");
                }
                Err(_) => node.clock.sleep(Duration::from_millis(200)),
            }
        }
    }
}
