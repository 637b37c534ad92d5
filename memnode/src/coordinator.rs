//! Which [`Coordinator`] a node uses, and the embedded one's RPC surface.
//!
//! With `--etcd` every node talks to etcd itself. Without, a [`rackfs_coord::Local`] holds the
//! cluster's keys: in the primary, or (`--coordinator ADDR`) in a process of its own that
//! outlives every node (`rackfs up`'s; see [`CoordService`]). Nodes reach one they do not hold
//! through [`Remote`], which carries each operation in a [`ControlRequest::Coord`] ([`serve`]
//! answers it) over a connection opened through the node's [`Dial`]: one interface, one
//! liveness protocol, whichever coordinator runs it.
//!
//! Keys a cluster keeps (relative to its prefix): `primary` (the primary's address, under its
//! lease: the election), `nodes/<id>` (a data node's address and epoch, under the lease
//! whose id is that epoch: the node is a member while the key lives), and `standby` (the data
//! node whose mirror of the namespace is in sync, written by the primary without a lease: it
//! must outlive the primary; see the `standby` module), and `mounts/<session>` (a mount's lock
//! lease, granted and kept alive by the primary on the mount's renewals; see
//! [`crate::lease`]).

use std::io::{BufReader, BufWriter, Write as _};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rackfs_clock::{Mutex, SharedClock, SystemClock};
use rackfs_coord::{CoordError, Coordinator, Etcd, Guard, LeaseId, Local, Write};
use rackfs_proto::control::{
    ControlRequest, ControlResponse, ErrorCode, NodeAddr, PROTOCOL_VERSION,
};
use rackfs_proto::coord::{CoordAnswer, CoordCall, CoordWrite};
use rackfs_proto::link::{ControlLink, Dial};
use rackfs_proto::{Refusal, RpcError};
use rackfs_verbs::auth::{server_handshake, NonceLog};
use rackfs_verbs::wire::{self, ConnKind, FrameKind, Welcome};
use rackfs_verbs::Secret;
use tracing::warn;

use crate::config::{Coordination, NodeConfig, Role};

/// The key of data node `id`'s membership.
pub fn node_key(id: u32) -> String {
    format!("nodes/{id}")
}

/// The value of the `primary` key for node `me`, whose mount sessions start at
/// `sessions_from` (data connections of lower sessions belong to an earlier primary's era).
pub fn primary_value(me: &NodeAddr, sessions_from: u64) -> Vec<u8> {
    let v = serde_json::json!({
        "name": me.name, "tcp": me.tcp, "node_id": me.node_id, "sessions_from": sessions_from,
    });
    v.to_string().into_bytes()
}

/// The elected primary as its key says: node id, tcp address, first session.
pub fn parse_primary(v: &[u8]) -> Option<(u32, String, u64)> {
    let m: serde_json::Value = serde_json::from_slice(v).ok()?;
    Some((
        m["node_id"].as_u64()? as u32,
        m["tcp"].as_str()?.to_string(),
        m["sessions_from"].as_u64().unwrap_or(0),
    ))
}

/// The value of the `standby` key: node `id` mirrors the namespace of primary `primary`.
pub fn standby_value(id: u32, primary: u32) -> Vec<u8> {
    serde_json::json!({ "node_id": id, "primary": primary })
        .to_string()
        .into_bytes()
}

/// The node the `standby` key names.
pub fn parse_standby(v: &[u8]) -> Option<u32> {
    let m: serde_json::Value = serde_json::from_slice(v).ok()?;
    Some(m["node_id"].as_u64()? as u32)
}

/// The value of data node `me`'s `nodes/<id>` key, registered under lease `epoch` (read back
/// by [`members`]).
pub fn node_value(me: &NodeAddr, epoch: LeaseId) -> Vec<u8> {
    let v = serde_json::json!({
        "epoch": epoch, "name": me.name, "tcp": me.tcp, "shm": me.shm, "domain": me.domain,
    });
    v.to_string().into_bytes()
}

/// The node ids and epochs of the members registered under `nodes/`.
pub fn members(c: &dyn Coordinator) -> Result<Vec<(u32, LeaseId)>, CoordError> {
    Ok(c.list("nodes/")?
        .into_iter()
        .filter_map(|(k, v)| {
            let id = k.strip_prefix("nodes/")?.parse().ok()?;
            let m: serde_json::Value = serde_json::from_slice(&v).ok()?;
            Some((id, m["epoch"].as_i64()?))
        })
        .collect())
}

/// A node's coordinator and, for a data node on the embedded one, the [`Remote`] behind it.
pub type Opened = (Arc<dyn Coordinator>, Option<Arc<Remote>>);

/// The coordinator of a node with configuration `cfg`, and, for a data node on the embedded
/// one, the [`Remote`] itself: it is pointed at the primary once the node found it. The one
/// embedded in the primary times its leases on `clock` (the node's); a [`Remote`] reaches
/// its holder through `dial` (the node's).
pub fn open(
    cfg: &NodeConfig,
    clock: &SharedClock,
    dial: &Arc<dyn Dial>,
) -> Result<Opened, CoordError> {
    let deadline = (cfg.node_lease / 2).max(Duration::from_millis(200));
    Ok(match (&cfg.coordinator, &cfg.role) {
        (Coordination::Etcd(endpoints), _) => (
            Arc::new(Etcd::new(endpoints, &cfg.cluster, deadline)?),
            None,
        ),
        (Coordination::Served(addr), _) => {
            let r = Remote::new(addr, &cfg.secret, &cfg.name, deadline, dial.clone());
            (Arc::new(Remote { served: true, ..r }), None)
        }
        (Coordination::InPrimary, Role::Join(addrs)) => {
            let first = addrs.first().map_or("", String::as_str);
            let r = Arc::new(Remote::new(
                first,
                &cfg.secret,
                &cfg.name,
                deadline,
                dial.clone(),
            ));
            (r.clone(), Some(r))
        }
        // The primary asks it at least every member check, an eighth of a lease.
        (Coordination::InPrimary, _) => (
            Arc::new(Local::with_clock(cfg.node_lease / 4, clock.clone())),
            None,
        ),
    })
}

/// An embedded coordinator held by another process: the primary, or one serving it alone.
pub struct Remote {
    /// Where it is: the primary's address (where the node joined), or the serving process's.
    primary: Mutex<String>,
    /// Served apart from the nodes (`--coordinator`), not by the primary.
    served: bool,
    secret: Secret,
    name: String,
    deadline: Duration,
    /// How the connection is opened (the node's dial).
    dial: Arc<dyn Dial>,
    conn: Mutex<Option<Arc<dyn ControlLink>>>,
}

impl Remote {
    /// Reaches the coordinator at `primary` through `dial`, each call giving up after
    /// `deadline`.
    pub fn new(
        primary: &str,
        secret: &Secret,
        name: &str,
        deadline: Duration,
        dial: Arc<dyn Dial>,
    ) -> Remote {
        Remote {
            primary: Mutex::new(primary.into()),
            served: false,
            secret: secret.clone(),
            name: format!("coord-{name}"),
            deadline,
            dial,
            conn: Mutex::new(None),
        }
    }

    /// From now on, asks the primary at `addr` (the one the node joined).
    pub fn point_at(&self, addr: &str) {
        let mut conn = self.conn.lock().expect("coordinator connection lock");
        *self.primary.lock().expect("primary address lock") = addr.into();
        *conn = None;
    }

    fn primary(&self) -> String {
        self.primary.lock().expect("primary address lock").clone()
    }

    fn call(&self, call: CoordCall) -> Result<CoordAnswer, CoordError> {
        let lease = match &call {
            CoordCall::KeepAlive { lease } => Some(*lease),
            CoordCall::Put { lease, .. } | CoordCall::Create { lease, .. } => *lease,
            CoordCall::WriteIf {
                write: CoordWrite::Put { lease, .. },
                ..
            } => *lease,
            _ => None,
        };
        let guard = match &call {
            CoordCall::WriteIf { guard, .. } => Some(guard.clone()),
            _ => None,
        };
        let primary = self.primary();
        let unreachable = |e: RpcError| CoordError::Unreachable {
            endpoints: primary.clone(),
            why: e.to_string(),
        };
        let mut conn = self.conn.lock().expect("coordinator connection lock");
        let c = match conn.take() {
            Some(c) => c,
            None => {
                let c = self
                    .dial
                    .connect(&primary, &self.secret, &self.name)
                    .map_err(unreachable)?;
                c.set_deadline(self.deadline);
                c
            }
        };
        match c.call(&ControlRequest::Coord(call)) {
            Ok(ControlResponse::Coord(a)) => {
                *conn = Some(c);
                Ok(a)
            }
            Ok(other) => Err(CoordError::Protocol {
                endpoint: primary.clone(),
                what: format!("{other:?}"),
            }),
            Err(RpcError::Refused {
                code: ErrorCode::Fenced,
                ..
            }) if lease.is_some() => {
                *conn = Some(c);
                Err(CoordError::Expired(lease.expect("checked")))
            }
            Err(RpcError::Refused {
                code: ErrorCode::NotPrimary,
                ..
            }) if guard.is_some() => {
                *conn = Some(c);
                let (key, lease) = guard.expect("checked");
                Err(CoordError::NotHeld { key, lease })
            }
            Err(e) => Err(unreachable(e)),
        }
    }
}

fn unexpected(a: CoordAnswer) -> CoordError {
    CoordError::Protocol {
        endpoint: "the primary".into(),
        what: format!("{a:?}"),
    }
}

impl Coordinator for Remote {
    fn grant(&self, ttl: Duration) -> Result<(LeaseId, Duration), CoordError> {
        match self.call(CoordCall::Grant {
            ttl_ms: ttl.as_millis() as u64,
        })? {
            CoordAnswer::Granted { lease, ttl_ms } => Ok((lease, Duration::from_millis(ttl_ms))),
            a => Err(unexpected(a)),
        }
    }

    fn keep_alive(&self, lease: LeaseId) -> Result<Duration, CoordError> {
        match self.call(CoordCall::KeepAlive { lease })? {
            CoordAnswer::Ttl { ms } => Ok(Duration::from_millis(ms)),
            a => Err(unexpected(a)),
        }
    }

    fn revoke(&self, lease: LeaseId) -> Result<(), CoordError> {
        self.call(CoordCall::Revoke { lease }).map(drop)
    }

    fn put(&self, key: &str, value: &[u8], lease: Option<LeaseId>) -> Result<(), CoordError> {
        self.call(CoordCall::Put {
            key: key.into(),
            value: value.to_vec(),
            lease,
        })
        .map(drop)
    }

    fn create(
        &self,
        key: &str,
        value: &[u8],
        lease: Option<LeaseId>,
    ) -> Result<Result<u64, Vec<u8>>, CoordError> {
        match self.call(CoordCall::Create {
            key: key.into(),
            value: value.to_vec(),
            lease,
        })? {
            CoordAnswer::Created(r) => Ok(r),
            a => Err(unexpected(a)),
        }
    }

    fn created(&self, key: &str) -> Result<Option<(u64, Vec<u8>)>, CoordError> {
        match self.call(CoordCall::Created { key: key.into() })? {
            CoordAnswer::Versioned(v) => Ok(v),
            a => Err(unexpected(a)),
        }
    }

    fn write_if(&self, guard: &Guard, write: Write) -> Result<(), CoordError> {
        let write = match write {
            Write::Put { key, value, lease } => CoordWrite::Put { key, value, lease },
            Write::Delete { key } => CoordWrite::Delete { key },
        };
        self.call(CoordCall::WriteIf {
            guard: (guard.key.clone(), guard.lease),
            write,
        })
        .map(drop)
    }

    fn holds(&self, guard: &Guard) -> Result<bool, CoordError> {
        match self.call(CoordCall::Holds {
            guard: (guard.key.clone(), guard.lease),
        })? {
            CoordAnswer::Holds(h) => Ok(h),
            a => Err(unexpected(a)),
        }
    }

    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, CoordError> {
        match self.call(CoordCall::Get { key: key.into() })? {
            CoordAnswer::Value(v) => Ok(v),
            a => Err(unexpected(a)),
        }
    }

    fn list(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, CoordError> {
        match self.call(CoordCall::List {
            prefix: prefix.into(),
        })? {
            CoordAnswer::Keys(v) => Ok(v),
            a => Err(unexpected(a)),
        }
    }

    fn delete(&self, key: &str) -> Result<(), CoordError> {
        self.call(CoordCall::Delete { key: key.into() }).map(drop)
    }

    fn describe(&self) -> String {
        match self.served {
            true => format!("embedded, served at {}", self.primary()),
            false => format!("embedded, in the primary at {}", self.primary()),
        }
    }
}

/// The primary's side of [`Remote`]: one operation on its own coordinator.
pub fn serve(c: &dyn Coordinator, call: CoordCall) -> Result<CoordAnswer, Refusal> {
    let r = match call {
        CoordCall::Grant { ttl_ms } => {
            c.grant(Duration::from_millis(ttl_ms))
                .map(|(lease, ttl)| CoordAnswer::Granted {
                    lease,
                    ttl_ms: ttl.as_millis() as u64,
                })
        }
        CoordCall::KeepAlive { lease } => c.keep_alive(lease).map(|ttl| CoordAnswer::Ttl {
            ms: ttl.as_millis() as u64,
        }),
        CoordCall::Revoke { lease } => c.revoke(lease).map(|_| CoordAnswer::Done),
        CoordCall::Put { key, value, lease } => {
            c.put(&key, &value, lease).map(|_| CoordAnswer::Done)
        }
        CoordCall::Create { key, value, lease } => {
            c.create(&key, &value, lease).map(CoordAnswer::Created)
        }
        CoordCall::Get { key } => c.get(&key).map(CoordAnswer::Value),
        CoordCall::List { prefix } => c.list(&prefix).map(CoordAnswer::Keys),
        CoordCall::Delete { key } => c.delete(&key).map(|_| CoordAnswer::Done),
        CoordCall::Created { key } => c.created(&key).map(CoordAnswer::Versioned),
        CoordCall::WriteIf {
            guard: (key, lease),
            write,
        } => {
            let write = match write {
                CoordWrite::Put { key, value, lease } => Write::Put { key, value, lease },
                CoordWrite::Delete { key } => Write::Delete { key },
            };
            c.write_if(&Guard { key, lease }, write)
                .map(|_| CoordAnswer::Done)
        }
        CoordCall::Holds {
            guard: (key, lease),
        } => c.holds(&Guard { key, lease }).map(CoordAnswer::Holds),
    };
    r.map_err(|e| match e {
        CoordError::Expired(_) => Refusal::new(ErrorCode::Fenced, e.to_string()),
        CoordError::NotHeld { .. } => Refusal::new(ErrorCode::NotPrimary, e.to_string()),
        other => Refusal::new(ErrorCode::Unavailable, other.to_string()),
    })
}

/// An embedded coordinator served on a Unix socket by a process that outlives every node
/// (`rackfs up`'s): nodes reach it with `--coordinator unix:PATH` and elect a primary in it as
/// they would in etcd. Its threads end with the process; dropping it removes the socket.
pub struct CoordService {
    path: PathBuf,
}

impl CoordService {
    /// Serves a fresh [`Local`] at `path` to clients proving `secret`. `node_lease` is the
    /// nodes' lease: a gap of a quarter of it between two looks at the clock means this process
    /// was paused, and every lease then restarts instead of lapsing (nobody could renew).
    /// A service of its own process, it runs on the host's clock.
    pub fn start(path: &Path, secret: Secret, node_lease: Duration) -> std::io::Result<Self> {
        let listener = UnixListener::bind(path)?;
        let clock: SharedClock = Arc::new(SystemClock::new());
        let coord = Arc::new(Local::with_clock(node_lease / 4, clock.clone()));
        let keeper = coord.clone();
        let look_every = (node_lease / 16).max(Duration::from_millis(5));
        std::thread::Builder::new()
            .name("coord-clock".into())
            .spawn(move || loop {
                // Any call looks at the clock: only a pause of the whole process leaves a gap.
                let _ = keeper.get("");
                clock.sleep(look_every);
            })?;
        let welcome = Welcome {
            proof: [0; rackfs_verbs::wire::PROOF_LEN],
            node_name: "coordinator".into(),
            node_id: u32::MAX,
            regions: Vec::new(),
        };
        let shared = Arc::new((secret, welcome, NonceLog::default()));
        std::thread::Builder::new()
            .name("coord-accept".into())
            .spawn(move || {
                for conn in listener.incoming().flatten() {
                    let (coord, shared) = (coord.clone(), shared.clone());
                    let _ = std::thread::Builder::new()
                        .name("coord-conn".into())
                        .spawn(move || serve_conn(conn, &*coord, &shared.0, &shared.1, &shared.2));
                }
            })?;
        Ok(CoordService {
            path: path.to_path_buf(),
        })
    }

    /// The address nodes are given (`--coordinator`).
    pub fn addr(&self) -> String {
        format!("unix:{}", self.path.display())
    }
}

impl Drop for CoordService {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// One client of a [`CoordService`]: authenticated, then answered call by call.
fn serve_conn(
    mut stream: UnixStream,
    coord: &dyn Coordinator,
    secret: &Secret,
    welcome: &Welcome,
    nonces: &NonceLog,
) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
    let admitted = server_handshake(&mut stream, secret, welcome, nonces, |h| match h.kind {
        ConnKind::Control => Ok(()),
        _ => Err("this is the cluster's coordinator: it serves control connections only".into()),
    });
    let client = match admitted {
        Ok(a) => a.hello.client_name,
        Err(e) => {
            warn!(error = %e, "coordinator: refused a connection");
            return;
        }
    };
    let _ = stream.set_read_timeout(None);
    let Ok(w) = stream.try_clone() else { return };
    let (mut r, mut w) = (BufReader::new(stream), BufWriter::new(w));
    let mut body = Vec::new();
    loop {
        let (id, req) = match wire::read_frame(&mut r, &mut body) {
            Ok(FrameKind::ControlRequest) => match ControlRequest::decode(&body) {
                Ok(r) => r,
                Err(e) => return warn!(%client, error = %e, "coordinator: malformed request"),
            },
            Ok(_) | Err(_) => return,
        };
        let resp = match req {
            ControlRequest::Hello { version } if version != PROTOCOL_VERSION => Refusal::new(
                ErrorCode::Version,
                format!("the coordinator speaks protocol version {PROTOCOL_VERSION}, the client {version}"),
            )
            .into(),
            ControlRequest::Hello { .. } => ControlResponse::Hello {
                version: PROTOCOL_VERSION,
            },
            ControlRequest::Coord(call) => match serve(coord, call) {
                Ok(a) => ControlResponse::Coord(a),
                Err(r) => r.into(),
            },
            _ => Refusal::new(
                ErrorCode::NotPrimary,
                "this is the cluster's coordinator, not a memory node",
            )
            .into(),
        };
        let sent = wire::write_frame(&mut w, FrameKind::ControlResponse, &resp.encode(id))
            .and_then(|()| w.flush());
        if sent.is_err() {
            return;
        }
    }
}
