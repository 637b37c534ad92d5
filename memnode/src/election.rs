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
        let attempt = coord.grant(ttl).and_then(|(lease, granted)| {
            let won = coord.create("primary", me.to_string().as_bytes(), Some(lease))?;
            Ok((lease, granted, won))
        });
        let (lease, granted, won) = match attempt {
            Ok(a) => a,
            // A coordinator that answers slowly or not yet: try again until giving up.
            Err(e) if Instant::now() > give_up => return Err(e.into()),
            Err(e) => {
                warn!(coordinator = %coord.describe(), error = %e, "cannot campaign for primary yet; retrying");
                std::thread::sleep(Duration::from_millis(200));
                continue;
            }
        };
        match won {
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
    /// Renews the primary's lease while the node runs, extending its serve lease from each
    /// renewal's sending. Once the lease lapsed (the coordinator was out of reach for a whole
    /// lease) the node serves nothing and campaigns again: it resumes if the key is still free
    /// and exits if another node took it.
    pub fn run(mut self, node: &Node) {
        let mut complained = false;
        while !node.is_stopping() {
            std::thread::sleep(self.every);
            let sent = monotonic_ns();
            match self.coord.keep_alive(self.lease) {
                Ok(ttl) => {
                    node.serve.extend_to(sent + ttl.as_nanos() as u64);
                    node.lease_words.publish(node.serve.until());
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

    /// Campaigns again after the lease lapsed.
    fn again(&mut self, node: &Node) {
        let me = node.members.me();
        let me = serde_json::json!({ "name": me.name, "tcp": me.tcp, "node_id": me.node_id });
        while !node.is_stopping() {
            let sent = monotonic_ns();
            let attempt = self
                .coord
                .grant(node.cfg.node_lease)
                .and_then(|(lease, ttl)| {
                    let won =
                        self.coord
                            .create("primary", me.to_string().as_bytes(), Some(lease))?;
                    Ok((lease, ttl, won))
                });
            match attempt {
                Ok((lease, ttl, Ok(()))) => {
                    info!(epoch = lease, "elected primary again: serving");
                    self.lease = lease;
                    node.serve.extend_to(sent + ttl.as_nanos() as u64);
                    node.lease_words.publish(node.serve.until());
                    return;
                }
                Ok((lease, _, Err(holder))) => {
                    let _ = self.coord.revoke(lease);
                    error!(holder = %String::from_utf8_lossy(&holder), "another node is primary now: this one exits");
                    std::process::exit(3);
                }
                Err(_) => std::thread::sleep(Duration::from_millis(200)),
            }
        }
    }
}
