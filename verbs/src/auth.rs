//! Connection set-up: mutual challenge-response authentication with the cluster secret.
//!
//! ```text
//! client -> Hello     { kind, nonce_c, client name, fence token, send time }
//! server -> Challenge { nonce_s }
//! client -> Proof     { proof_c = HMAC(secret, "rackfs-client" | nonce_s | nonce_c) }
//! server -> Welcome   { proof_s = HMAC(secret, "rackfs-server" | nonce_c | nonce_s),
//!                       node name, node id, regions }        or    Refused { reason }
//! ```
//! The secret never crosses the wire; both sides prove knowledge of it with fresh nonces. The
//! client proves first: a peer that does not know the secret gets a nonce and a refusal, never
//! a proof it could test guesses of the secret against offline. The node remembers recent
//! client nonces, so a recorded client exchange played again is refused and logged as a
//! replay; the client checks the node's proof before using the connection.

use std::collections::{HashSet, VecDeque};
use std::io::{Read, Write};
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::wire::{
    self, Challenge, ConnKind, FrameKind, Hello, Welcome, WireError, NONCE_LEN, PROOF_LEN,
};
use crate::VerbsError;

/// The cluster secret shared by memory nodes and mounts.
#[derive(Clone)]
pub struct Secret(Vec<u8>);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// Why a cluster secret was refused.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error("the cluster secret is empty")]
    Empty,
    #[error("cannot read secret file {}: {err}", .path.display())]
    Read {
        path: std::path::PathBuf,
        #[source]
        err: std::io::Error,
    },
    #[error("the cluster secret is empty (secret file {})", .0.display())]
    EmptyFile(std::path::PathBuf),
    #[error(
        "the cluster secret in {} is too weak ({why}): use at least {MIN_SECRET_LEN} random \
         characters, e.g. `od -An -N32 -tx1 /dev/urandom | tr -d ' \\n' > {}`",
        .path.display(),
        .path.display()
    )]
    Weak {
        path: std::path::PathBuf,
        why: String,
    },
}

/// The shortest secret a secret file may hold.
pub const MIN_SECRET_LEN: usize = 16;

/// Why `bytes` are too weak a secret, if they are: too short, or too few distinct characters
/// (a repeated or dictionary-like word).
fn weakness(bytes: &[u8]) -> Option<String> {
    if bytes.len() < MIN_SECRET_LEN {
        return Some(format!("{} characters", bytes.len()));
    }
    let distinct = bytes.iter().collect::<HashSet<_>>().len();
    (distinct < 8).then(|| format!("only {distinct} distinct characters"))
}

impl Secret {
    /// A secret from bytes; surrounding whitespace is ignored. Fails when empty.
    pub fn new(bytes: &[u8]) -> Result<Secret, SecretError> {
        let trimmed = bytes.trim_ascii();
        if trimmed.is_empty() {
            return Err(SecretError::Empty);
        }
        Ok(Secret(trimmed.to_vec()))
    }

    /// Reads a secret file (its whole content, trimmed).
    pub fn from_file(path: &Path) -> Result<Secret, SecretError> {
        let bytes = std::fs::read(path).map_err(|err| SecretError::Read {
            path: path.into(),
            err,
        })?;
        let secret = Secret::new(&bytes).map_err(|_| SecretError::EmptyFile(path.into()))?;
        if let Some(why) = weakness(&secret.0) {
            return Err(SecretError::Weak {
                path: path.into(),
                why,
            });
        }
        Ok(secret)
    }

    /// A fresh random secret, hex-encoded (for `rackfs up` and tests).
    pub fn generate() -> Secret {
        let mut raw = [0u8; 32];
        getrandom::getrandom(&mut raw).expect("the OS random source works");
        Secret(
            raw.iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>()
                .into_bytes(),
        )
    }

    /// The secret's bytes, for writing a secret file.
    pub fn expose(&self) -> &[u8] {
        &self.0
    }

    fn mac(&self, label: &[u8], a: &[u8], b: &[u8]) -> Hmac<Sha256> {
        let mut m = Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes any key length");
        m.update(label);
        m.update(a);
        m.update(b);
        m
    }

    fn prove(&self, label: &[u8], a: &[u8], b: &[u8]) -> [u8; PROOF_LEN] {
        self.mac(label, a, b).finalize().into_bytes().into()
    }

    fn verify(&self, label: &[u8], a: &[u8], b: &[u8], proof: &[u8]) -> bool {
        self.mac(label, a, b).verify_slice(proof).is_ok()
    }
}

const SERVER_LABEL: &[u8] = b"rackfs-server";
const CLIENT_LABEL: &[u8] = b"rackfs-client";

pub fn nonce() -> [u8; NONCE_LEN] {
    let mut n = [0u8; NONCE_LEN];
    getrandom::getrandom(&mut n).expect("the OS random source works");
    n
}

/// Client nonces a node has seen recently: a hello that repeats one replays a recorded
/// handshake. Kept for [`NonceLog::KEEP`], at most [`NonceLog::MAX`] of them.
#[derive(Default)]
pub struct NonceLog {
    seen: Mutex<Seen>,
}

/// The nonces, as a set and in arrival order (for expiry).
#[derive(Default)]
struct Seen {
    set: HashSet<[u8; NONCE_LEN]>,
    order: VecDeque<([u8; NONCE_LEN], Instant)>,
}

impl NonceLog {
    pub const KEEP: Duration = Duration::from_secs(600);
    pub const MAX: usize = 1 << 16;

    /// Records `n`; false if it was seen within the window (a replay).
    pub fn fresh(&self, n: &[u8; NONCE_LEN]) -> bool {
        let mut g = self.seen.lock().expect("nonce log lock");
        let Seen { set, order } = &mut *g;
        let now = Instant::now();
        while order
            .front()
            .is_some_and(|(_, t)| now.duration_since(*t) > Self::KEEP || set.len() >= Self::MAX)
        {
            let (old, _) = order.pop_front().expect("front");
            set.remove(&old);
        }
        if !set.insert(*n) {
            return false;
        }
        order.push_back((*n, now));
        true
    }
}

/// What a successful client handshake learned about the node.
#[derive(Debug, Clone)]
pub struct Accepted {
    pub welcome: Welcome,
    pub node_name: String,
}

fn wire_err(peer: &str, e: WireError) -> VerbsError {
    match e {
        WireError::Closed => VerbsError::ConnectionLost {
            peer: peer.into(),
            reason: "closed during the handshake".into(),
        },
        WireError::Malformed {
            what: "handshake",
            why,
        } => VerbsError::Auth {
            peer: peer.into(),
            reason: why,
        },
        other => VerbsError::Protocol {
            peer: peer.into(),
            reason: other.to_string(),
        },
    }
}

/// Runs the client side of the handshake on a fresh stream.
pub fn client_handshake<S: Read + Write>(
    stream: &mut S,
    kind: ConnKind,
    secret: &Secret,
    client_name: &str,
    fence: u64,
    peer: &str,
) -> Result<Accepted, VerbsError> {
    let io = |e: std::io::Error| wire_err(peer, WireError::Io(e));
    let hello = Hello {
        kind,
        nonce: nonce(),
        client_name: client_name.into(),
        fence,
        sent_ns: crate::tcp::wall_ns(),
    };
    wire::write_frame(stream, FrameKind::Hello, &hello.encode()).map_err(io)?;
    let body = wire::expect_frame(stream, FrameKind::Challenge).map_err(|e| wire_err(peer, e))?;
    let challenge = Challenge::decode(&body).map_err(|e| wire_err(peer, e))?;
    let proof = secret.prove(CLIENT_LABEL, &challenge.nonce, &hello.nonce);
    wire::write_frame(stream, FrameKind::Proof, &proof).map_err(io)?;
    let body = wire::expect_frame(stream, FrameKind::Welcome).map_err(|e| wire_err(peer, e))?;
    let welcome = Welcome::decode(&body).map_err(|e| wire_err(peer, e))?;
    if !secret.verify(SERVER_LABEL, &hello.nonce, &challenge.nonce, &welcome.proof) {
        return Err(VerbsError::Auth {
            peer: peer.into(),
            reason: "the memory node's proof does not match this cluster secret".into(),
        });
    }
    Ok(Accepted {
        node_name: welcome.node_name.clone(),
        welcome,
    })
}

/// A client a server-side handshake admitted.
#[derive(Debug, Clone)]
pub struct Admitted {
    pub hello: Hello,
    /// The node's wall clock when the hello arrived (ns since the epoch): with
    /// [`Hello::sent_ns`], the connection's first clock-offset sample.
    pub received_ns: u64,
}

impl Admitted {
    /// The node's clock minus the client's, plus the hello's delivery time (ns).
    pub fn clock_offset_ns(&self) -> i128 {
        self.received_ns as i128 - self.hello.sent_ns as i128
    }
}

/// Why a server-side handshake did not admit a client.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    #[error("client {client} failed authentication: wrong cluster secret")]
    WrongSecret { client: String },
    #[error("client {client} replayed a recorded handshake (its nonce was used before)")]
    Replay { client: String },
    /// An authenticated client asked for what this node does not serve it (told why).
    #[error("client {client} not admitted: {reason}")]
    NotAdmitted { client: String, reason: String },
    #[error("{0}")]
    Wire(#[from] WireError),
}

/// Runs the server side of the handshake; returns the client's hello once it has proven the secret.
///
/// `admit` decides, from the hello, whether this listener serves that kind of connection;
/// `welcome` is sent with this connection's proof filled in; `nonces` catches replays.
pub fn server_handshake<S: Read + Write>(
    stream: &mut S,
    secret: &Secret,
    welcome: &Welcome,
    nonces: &NonceLog,
    admit: impl FnOnce(&Hello) -> Result<(), String>,
) -> Result<Admitted, HandshakeError> {
    let refuse = |stream: &mut S, reason: &str| {
        let mut b = Vec::new();
        wire::put_str(&mut b, reason);
        let _ = wire::write_frame(stream, FrameKind::Refused, &b);
    };
    let mut body = Vec::new();
    let hello = match wire::read_frame(stream, &mut body).and_then(|k| match k {
        FrameKind::Hello => Hello::decode(&body),
        other => Err(WireError::Unexpected {
            expected: FrameKind::Hello,
            got: other,
        }),
    }) {
        Ok(h) => h,
        Err(e) => {
            if !matches!(e, WireError::Closed | WireError::Io(_)) {
                refuse(stream, &e.to_string());
            }
            return Err(e.into());
        }
    };
    let received_ns = crate::tcp::wall_ns();
    if !nonces.fresh(&hello.nonce) {
        refuse(stream, "replayed handshake");
        return Err(HandshakeError::Replay {
            client: hello.client_name,
        });
    }
    let server_nonce = nonce();
    let challenge = Challenge {
        nonce: server_nonce,
    };
    wire::write_frame(stream, FrameKind::Challenge, &challenge.encode()).map_err(WireError::Io)?;
    let proof = wire::expect_frame(stream, FrameKind::Proof)?;
    if !secret.verify(CLIENT_LABEL, &server_nonce, &hello.nonce, &proof) {
        refuse(
            stream,
            &format!(
                "wrong cluster secret: memory node {} could not verify the client's proof",
                welcome.node_name
            ),
        );
        return Err(HandshakeError::WrongSecret {
            client: hello.client_name,
        });
    }
    if let Err(reason) = admit(&hello) {
        refuse(stream, &reason);
        return Err(HandshakeError::NotAdmitted {
            client: hello.client_name,
            reason,
        });
    }
    let welcome = Welcome {
        proof: secret.prove(SERVER_LABEL, &hello.nonce, &server_nonce),
        ..welcome.clone()
    };
    wire::write_frame(stream, FrameKind::Welcome, &welcome.encode()).map_err(WireError::Io)?;
    Ok(Admitted { hello, received_ns })
}
