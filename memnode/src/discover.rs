//! Finding the primary a data node joins.
//!
//! A unit's command line is fixed but the primary moves (a standby takes over), so a data node
//! is given a list of addresses (`--join A,B,C`) and, with a coordinator that elects (etcd, or
//! one served apart), the coordinator's `primary` key: it asks them in turn to take it in, skipping a node that answers that it is not the
//! primary (or is not serving yet) and one that does not answer, and goes round again until
//! one accepts or its patience ([`patience`]) runs out. Every other refusal (a wrong secret,
//! its node id taken, another protocol version) ends the search at once: asking again would
//! not change it.

use std::fmt;
use std::time::Duration;

use rackfs_proto::control::ErrorCode;
use rackfs_proto::RpcError;
use rackfs_verbs::VerbsError;
use tracing::{info, warn};

use crate::config::{Coordination, Role};
use crate::coordinator::parse_primary;
use crate::node::Node;
use crate::term::PRIMARY_KEY;

/// What a data node's `--join`, `--etcd` or `--coordinator` lacks, or why no primary took it in.
#[derive(Debug, thiserror::Error)]
pub enum JoinError {
    #[error(
        "a data node needs the primary's address: give --join ADDR[,ADDR...] \
         (host:port or unix:PATH), or --etcd ENDPOINTS or --coordinator ADDR to find it there"
    )]
    NothingToJoin,
    #[error("no primary took this node in within {waited:?}; tried: {tried}")]
    NoPrimary { waited: Duration, tried: Tried },
    #[error("the primary at {addr} refused this node: {err}")]
    Refused {
        addr: String,
        #[source]
        err: RpcError,
    },
}

/// A `--join` address that is neither `host:port` nor `unix:PATH`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AddrError {
    #[error("an empty address (write host:port or unix:PATH, several separated by commas)")]
    Empty,
    #[error("{0:?} has no port: write host:port (e.g. 10.0.0.5:7070) or unix:PATH")]
    NoPort(String),
    #[error("{addr:?}: {port:?} is not a port number (1 to 65535)")]
    BadPort { addr: String, port: String },
    #[error("{0:?} has no host before its port: write host:port (e.g. 10.0.0.5:7070)")]
    NoHost(String),
    #[error("{0:?} names no socket path after unix:")]
    NoPath(String),
}

/// Checks one `--join` address: `host:port` (`[v6]:port` too) or `unix:PATH`. Names are not
/// resolved here: DNS may not answer yet when a unit starts at boot.
pub fn parse_addr(s: &str) -> Result<String, AddrError> {
    let s = s.trim();
    if s.is_empty() {
        return Err(AddrError::Empty);
    }
    if let Some(path) = s.strip_prefix("unix:") {
        return match path.is_empty() {
            true => Err(AddrError::NoPath(s.into())),
            false => Ok(s.into()),
        };
    }
    let Some((host, port)) = s.rsplit_once(':') else {
        return Err(AddrError::NoPort(s.into()));
    };
    if host.is_empty() || host == "[]" {
        return Err(AddrError::NoHost(s.into()));
    }
    if host.contains(':') && !(host.starts_with('[') && host.ends_with(']')) {
        // An IPv6 address without brackets: its last group is not a port.
        return Err(AddrError::NoPort(s.into()));
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 => Ok(s.into()),
        _ => Err(AddrError::BadPort {
            addr: s.into(),
            port: port.into(),
        }),
    }
}

/// Checks a node's role against its coordinator: a data node must have somewhere to look for
/// the primary (a coordinator that elects, or at least one address).
pub fn check(role: &Role, coordinator: &Coordination) -> Result<(), JoinError> {
    match role {
        Role::Join(addrs) if addrs.is_empty() && !coordinator.elects() => {
            Err(JoinError::NothingToJoin)
        }
        _ => Ok(()),
    }
}

/// How long a data node looks for the primary before giving up: long enough for a standby to
/// take over after the primary died (a lease and a campaign), and for a cluster whose units
/// start together to get its primary up.
pub fn patience(node_lease: Duration) -> Duration {
    (5 * node_lease).max(Duration::from_secs(10))
}

/// Every place asked, and what each answered the last time, for the error that names them.
#[derive(Debug, Default)]
pub struct Tried(Vec<(String, String)>);

impl Tried {
    /// Notes `why` for `place`; whether it is news (first seen, or another answer than before),
    /// so it is logged once, not every round.
    fn note(&mut self, place: &str, why: String) -> bool {
        match self.0.iter_mut().find(|(p, _)| p == place) {
            Some((_, w)) if *w == why => false,
            Some((_, w)) => {
                *w = why;
                true
            }
            None => {
                self.0.push((place.into(), why));
                true
            }
        }
    }
}

impl fmt::Display for Tried {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (place, why)) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{place} ({why})")?;
        }
        Ok(())
    }
}

/// Whether an answer passes the address over (it is not the primary, or does not answer)
/// rather than ending the search.
fn passes_over(e: &RpcError) -> bool {
    match e {
        RpcError::Refused { code, .. } => {
            matches!(code, ErrorCode::NotPrimary | ErrorCode::Unavailable)
        }
        RpcError::Connection(VerbsError::Auth { .. }) => false,
        RpcError::Connection(_) | RpcError::Timeout { .. } => true,
        RpcError::Version { .. } | RpcError::Unexpected { .. } => false,
    }
}

/// The addresses to ask this round: with a coordinator that elects, the one its `primary` key
/// names first, then
/// `addrs` in their order (each once).
fn candidates(node: &Node, addrs: &[String], tried: &mut Tried) -> Vec<String> {
    let mut out = Vec::new();
    if node.cfg.coordinator.elects() {
        let place = "the coordinator's primary key";
        let why = match node.coord.created(PRIMARY_KEY) {
            Ok(Some((term, v))) => match parse_primary(&v) {
                Some((id, _, _)) if id == node.cfg.node_id => Some(format!(
                    "it names this node's id {id}: an earlier run of it, whose lease has not lapsed yet"
                )),
                Some((_, tcp, _)) => {
                    node.followed.learn(term);
                    out.push(tcp);
                    None
                }
                None => Some("it names no tcp address".into()),
            },
            Ok(None) => Some("no primary is elected".into()),
            Err(e) => Some(e.to_string()),
        };
        if let Some(why) = why {
            if tried.note(place, why.clone()) {
                info!(reason = %why, "no primary from the coordinator yet");
            }
        }
    }
    for a in addrs {
        if !out.contains(a) {
            out.push(a.clone());
        }
    }
    out
}

/// Joins the primary, found among `addrs` and (with a coordinator that elects) its `primary` key;
/// returns the address that took the node in.
pub fn join(node: &Node, addrs: &[String]) -> Result<String, JoinError> {
    check(&node.cfg.role, &node.cfg.coordinator)?;
    let started = node.clock.now();
    let give_up = started + patience(node.cfg.node_lease);
    let mut tried = Tried::default();
    loop {
        for addr in candidates(node, addrs, &mut tried) {
            match node
                .members
                .join(&*node.dial, &addr, &node.cfg.secret, None)
            {
                Ok(()) => {
                    info!(primary = %addr, "joined the primary");
                    return Ok(addr);
                }
                Err(err) if passes_over(&err) => {
                    let why = err.to_string();
                    if tried.note(&addr, why.clone()) {
                        warn!(%addr, reason = %why, "not the primary, or no answer: trying the next address");
                    }
                }
                Err(err) => return Err(JoinError::Refused { addr, err }),
            }
            if node.is_stopping() {
                break;
            }
        }
        let now = node.clock.now();
        if now >= give_up || node.is_stopping() {
            let waited = now.saturating_sub(started);
            return Err(JoinError::NoPrimary {
                waited: Duration::from_millis(waited.as_millis() as u64),
                tried,
            });
        }
        node.clock
            .sleep((give_up - now).min(Duration::from_millis(300)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_host_port_or_unix_paths() {
        for good in [
            "10.0.0.5:7070",
            "mn0.rack1:7070",
            "[::1]:7070",
            "unix:/run/rackfs/mn0.sock",
            " 10.0.0.5:7070 ",
        ] {
            assert_eq!(parse_addr(good), Ok(good.trim().to_string()), "{good}");
        }
        assert_eq!(parse_addr(""), Err(AddrError::Empty));
        assert_eq!(parse_addr("  "), Err(AddrError::Empty));
        assert_eq!(
            parse_addr("10.0.0.5"),
            Err(AddrError::NoPort("10.0.0.5".into()))
        );
        assert_eq!(parse_addr("::1"), Err(AddrError::NoPort("::1".into())));
        assert_eq!(parse_addr(":7070"), Err(AddrError::NoHost(":7070".into())));
        assert_eq!(parse_addr("unix:"), Err(AddrError::NoPath("unix:".into())));
        for (bad, port) in [("h:0", "0"), ("h:70000", "70000"), ("h:http", "http")] {
            assert_eq!(
                parse_addr(bad),
                Err(AddrError::BadPort {
                    addr: bad.into(),
                    port: port.into()
                })
            );
        }
        let e = parse_addr("10.0.0.5:x").unwrap_err().to_string();
        assert!(e.contains("\"x\" is not a port number"), "{e}");
    }

    #[test]
    fn a_data_node_needs_an_address_or_etcd() {
        let e = check(&Role::Join(vec![]), &Coordination::InPrimary).unwrap_err();
        assert!(matches!(e, JoinError::NothingToJoin));
        assert!(e.to_string().contains("--join ADDR") && e.to_string().contains("--etcd"));
        check(
            &Role::Join(vec![]),
            &Coordination::Etcd("127.0.0.1:2379".into()),
        )
        .unwrap();
        check(
            &Role::Join(vec![]),
            &Coordination::Served("unix:/c.sock".into()),
        )
        .unwrap();
        check(&Role::Join(vec!["h:1".into()]), &Coordination::InPrimary).unwrap();
        check(&Role::Primary, &Coordination::InPrimary).unwrap();
        check(&Role::Standalone, &Coordination::InPrimary).unwrap();
    }

    #[test]
    fn the_error_names_every_place_tried_with_its_last_answer() {
        let mut t = Tried::default();
        assert!(t.note("a:1", "refused".into()));
        assert!(
            !t.note("a:1", "refused".into()),
            "the same answer is not news"
        );
        assert!(t.note("b:2", "node mn1 is not the primary".into()));
        assert!(t.note("a:1", "timed out".into()));
        let e = JoinError::NoPrimary {
            waited: Duration::from_secs(10),
            tried: t,
        };
        assert_eq!(
            e.to_string(),
            "no primary took this node in within 10s; tried: a:1 (timed out); \
             b:2 (node mn1 is not the primary)"
        );
    }

    #[test]
    fn only_not_the_primary_and_no_answer_pass_an_address_over() {
        let refused = |code| RpcError::Refused {
            code,
            message: String::new(),
        };
        assert!(passes_over(&refused(ErrorCode::NotPrimary)));
        assert!(passes_over(&refused(ErrorCode::Unavailable)));
        assert!(!passes_over(&refused(ErrorCode::Exists)));
        assert!(passes_over(&RpcError::Connection(VerbsError::Connect {
            peer: "a".into(),
            reason: "refused".into()
        })));
        assert!(!passes_over(&RpcError::Connection(VerbsError::Auth {
            peer: "a".into(),
            reason: "wrong cluster secret".into()
        })));
    }
}
