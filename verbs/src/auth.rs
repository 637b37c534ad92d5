//! Connection set-up: mutual challenge-response authentication with the cluster secret.
//!
//! ```text
//! client -> Hello     { kind, nonce_c, client name }
//! server -> Challenge { nonce_s, proof_s = HMAC(secret, "rackfs-server" | nonce_c | nonce_s), node name }
//! client -> Proof     { proof_c = HMAC(secret, "rackfs-client" | nonce_s | nonce_c) }
//! server -> Welcome   { node id, regions }    or    Refused { reason }
//! ```
//! The secret never crosses the wire; both sides prove knowledge of it with fresh nonces, so a
//! recorded exchange cannot be replayed. A client always sends its proof (so the node can log a
//! wrong secret plainly) and then checks the node's proof before using the connection.

use std::io::{Read, Write};
use std::path::Path;

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
        Secret::new(&bytes).map_err(|_| SecretError::EmptyFile(path.into()))
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
    peer: &str,
) -> Result<Accepted, VerbsError> {
    let io = |e: std::io::Error| wire_err(peer, WireError::Io(e));
    let hello = Hello {
        kind,
        nonce: nonce(),
        client_name: client_name.into(),
    };
    wire::write_frame(stream, FrameKind::Hello, &hello.encode()).map_err(io)?;
    let body = wire::expect_frame(stream, FrameKind::Challenge).map_err(|e| wire_err(peer, e))?;
    let challenge = Challenge::decode(&body).map_err(|e| wire_err(peer, e))?;
    let proof = secret.prove(CLIENT_LABEL, &challenge.nonce, &hello.nonce);
    wire::write_frame(stream, FrameKind::Proof, &proof).map_err(io)?;
    let server_ok = secret.verify(
        SERVER_LABEL,
        &hello.nonce,
        &challenge.nonce,
        &challenge.proof,
    );
    let body = wire::expect_frame(stream, FrameKind::Welcome).map_err(|e| wire_err(peer, e))?;
    if !server_ok {
        return Err(VerbsError::Auth {
            peer: peer.into(),
            reason: "the memory node's proof does not match this cluster secret".into(),
        });
    }
    let welcome = Welcome::decode(&body).map_err(|e| wire_err(peer, e))?;
    Ok(Accepted {
        welcome,
        node_name: challenge.node_name,
    })
}

/// Why a server-side handshake did not admit a client.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    #[error("client {client} failed authentication: wrong cluster secret")]
    WrongSecret { client: String },
    #[error("{0}")]
    Wire(#[from] WireError),
}

/// Runs the server side of the handshake; returns the client's hello once it has proven the secret.
///
/// `admit` decides, from the hello, whether this listener serves that kind of connection.
pub fn server_handshake<S: Read + Write>(
    stream: &mut S,
    secret: &Secret,
    node_name: &str,
    welcome: &Welcome,
    admit: impl FnOnce(&Hello) -> Result<(), String>,
) -> Result<Hello, HandshakeError> {
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
    let server_nonce = nonce();
    let challenge = Challenge {
        nonce: server_nonce,
        proof: secret.prove(SERVER_LABEL, &hello.nonce, &server_nonce),
        node_name: node_name.into(),
    };
    wire::write_frame(stream, FrameKind::Challenge, &challenge.encode()).map_err(WireError::Io)?;
    let proof = wire::expect_frame(stream, FrameKind::Proof)?;
    if !secret.verify(CLIENT_LABEL, &server_nonce, &hello.nonce, &proof) {
        refuse(
            stream,
            &format!(
                "wrong cluster secret: memory node {node_name} could not verify the client's proof"
            ),
        );
        return Err(HandshakeError::WrongSecret {
            client: hello.client_name,
        });
    }
    if let Err(reason) = admit(&hello) {
        refuse(stream, &reason);
        return Err(WireError::malformed("handshake", reason).into());
    }
    wire::write_frame(stream, FrameKind::Welcome, &welcome.encode()).map_err(WireError::Io)?;
    Ok(hello)
}
