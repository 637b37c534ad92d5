//! The primary's election: a primary holds the coordinator's `primary` key under a lease of
//! its own, for as long as it acts. Created only if absent, the key admits one primary per
//! cluster; a primary starting while an earlier one's key lives waits out that lease (a killed
//! primary's lease lapses by itself). With etcd the primary serves data and metadata only while
//! its lease holds, timed from each renewal's sending, and stops (exits) once it lapsed, before
//! etcd lets anyone else take the key: no two primaries ever act at once. The embedded
//! coordinator lives in the primary itself, so there it simply holds.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rackfs_coord::{renew_every, CoordError, Coordinator, LeaseId};
use rackfs_verbs::lease::monotonic_ns;
use tracing::{error, info, warn};

use crate::node::Node;

/// Why a primary could not take the cluster.
#[derive(Debug, thiserror::Error)]
pub enum ElectionError {
    #[error("another primary holds cluster {cluster}: {holder}")]
    Held { cluster: String, holder: String },
    #[error("the coordinator: {0}")]
    Coordinator(#[from] CoordError),
}

/// A primary's hold on its cluster.
pub struct Primacy {
    coord: Arc<dyn Coordinator>,
    lease: LeaseId,
    every: Duration,
}

/// Takes the `primary` key for this node, waiting out an earlier holder's lease for up to
/// twice `ttl` (plus a second).
pub fn campaign(
    coord: Arc<dyn Coordinator>,
    me: &serde_json::Value,
    ttl: Duration,
    cluster: &str,
) -> Result<(Primacy, u64), ElectionError> {
    let give_up = Instant::now() + 2 * ttl + Duration::from_secs(1);
    let mut told = false;
    loop {
        let sent = monotonic_ns();
        let (lease, granted) = coord.grant(ttl)?;
        match coord.create("primary", me.to_string().as_bytes(), Some(lease))? {
            Ok(()) => {
                info!(coordinator = %coord.describe(), epoch = lease, "elected primary of the cluster");
                let p = Primacy {
                    coord,
                    lease,
                    every: renew_every(granted),
                };
                return Ok((p, sent + granted.as_nanos() as u64));
            }
            Err(holder) => {
                let _ = coord.revoke(lease);
                let holder = String::from_utf8_lossy(&holder).to_string();
                if Instant::now() > give_up {
                    return Err(ElectionError::Held {
                        cluster: cluster.into(),
                        holder,
                    });
                }
                if !std::mem::replace(&mut told, true) {
                    info!(%holder, "the cluster has a primary's key: waiting for its lease to lapse");
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }
}

impl Primacy {
    /// Renews the primary's lease while the node runs; extends its serve lease from each
    /// renewal's sending. Once the lease lapsed the process exits: someone else may be primary.
    pub fn run(self, node: &Node) {
        let mut complained = false;
        while !node.is_stopping() {
            std::thread::sleep(self.every);
            let sent = monotonic_ns();
            match self.coord.keep_alive(self.lease) {
                Ok(ttl) => {
                    node.serve.extend_to(sent + ttl.as_nanos() as u64);
                    node.lease_words.publish(node.serve.until());
                    complained = false;
                }
                Err(CoordError::Expired(_)) => {
                    error!(coordinator = %self.coord.describe(), "this primary's lease lapsed: another node may be primary now, so this one stops");
                    std::process::exit(3);
                }
                Err(e) => {
                    if !std::mem::replace(&mut complained, true) {
                        warn!(coordinator = %self.coord.describe(), error = %e, "cannot renew the primary's lease; it stops serving when the lease lapses");
                    }
                    if !node.serve.valid() {
                        error!("this primary's lease lapsed while the coordinator was unreachable: it stops");
                        std::process::exit(3);
                    }
                }
            }
        }
    }
}
