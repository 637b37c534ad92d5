//! [`Coordinator`] on etcd, through its v3 JSON gateway (`POST /v3/...` on the client port):
//! one short HTTP/1.1 exchange per call, each under a deadline, trying the endpoints in turn.
//! Keys live under `/rackfs/<cluster>/`; keys and values travel base64-encoded, numbers as
//! decimal strings (the gateway's encoding of 64-bit integers).

use std::io::{Read, Write as _};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use serde_json::{json, Value};

use crate::{CoordError, Coordinator, Guard, LeaseId, Write};

/// An etcd cluster, as `host:port` client endpoints, and this RackFS cluster's key prefix.
pub struct Etcd {
    endpoints: Vec<String>,
    prefix: String,
    deadline: Duration,
}

/// The key just after every key starting with `p` (etcd's `range_end` for a prefix).
fn prefix_end(p: &[u8]) -> Vec<u8> {
    let mut end = p.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

fn num(v: &Value) -> Option<i64> {
    match v {
        Value::String(s) => s.parse().ok(),
        Value::Number(n) => n.as_i64(),
        _ => None,
    }
}

impl Etcd {
    /// `endpoints`: comma-separated `host:port` or `http://host:port`; `cluster`: the name
    /// whose keys this is (several RackFS clusters may share one etcd).
    pub fn new(endpoints: &str, cluster: &str, deadline: Duration) -> Result<Etcd, CoordError> {
        let endpoints: Vec<String> = endpoints
            .split(',')
            .map(|e| e.trim().trim_start_matches("http://").trim_end_matches('/'))
            .filter(|e| !e.is_empty())
            .map(String::from)
            .collect();
        if endpoints.is_empty() || cluster.is_empty() || cluster.contains('/') {
            return Err(CoordError::Unreachable {
                endpoints: endpoints.join(","),
                why: "give at least one etcd endpoint and a cluster name without '/'".into(),
            });
        }
        Ok(Etcd {
            endpoints,
            prefix: format!("/rackfs/{cluster}/"),
            deadline,
        })
    }

    fn key(&self, k: &str) -> String {
        B64.encode(format!("{}{k}", self.prefix))
    }

    /// The compares of a txn that succeeds only while `guard` holds: the key exists (a missing
    /// key compares as lease 0) and is under the guard's lease.
    fn held(&self, guard: &Guard) -> Value {
        let k = self.key(&guard.key);
        json!([
            { "key": k, "target": "CREATE", "result": "GREATER", "create_revision": "0" },
            { "key": k, "target": "LEASE", "result": "EQUAL", "lease": guard.lease.to_string() },
        ])
    }

    /// A txn under `lease` (if any): etcd's "lease not found" means it lapsed.
    fn txn(&self, body: Value, lease: Option<LeaseId>) -> Result<Value, CoordError> {
        match (self.call("/v3/kv/txn", body), lease) {
            (Err(CoordError::Protocol { what, .. }), Some(id))
                if what.contains("lease not found") =>
            {
                Err(CoordError::Expired(id))
            }
            (v, _) => v,
        }
    }

    /// One call: `body` posted to `path` on the first endpoint that answers.
    fn call(&self, path: &str, body: Value) -> Result<Value, CoordError> {
        let body = body.to_string();
        let mut last = String::new();
        for ep in &self.endpoints {
            match self.exchange(ep, path, &body) {
                Ok(v) => return Ok(v),
                Err(Exchange::Transport(why)) => last = format!("{ep}: {why}"),
                Err(Exchange::Answer(what)) => {
                    return Err(CoordError::Protocol {
                        endpoint: ep.clone(),
                        what,
                    })
                }
            }
        }
        Err(CoordError::Unreachable {
            endpoints: self.endpoints.join(","),
            why: last,
        })
    }

    fn exchange(&self, ep: &str, path: &str, body: &str) -> Result<Value, Exchange> {
        let t = |e: std::io::Error| Exchange::Transport(e.to_string());
        let addr = ep
            .to_socket_addrs()
            .map_err(t)?
            .next()
            .ok_or_else(|| Exchange::Transport("no address".into()))?;
        let mut s = TcpStream::connect_timeout(&addr, self.deadline).map_err(t)?;
        s.set_read_timeout(Some(self.deadline)).map_err(t)?;
        s.set_write_timeout(Some(self.deadline)).map_err(t)?;
        s.set_nodelay(true).map_err(t)?;
        let req = format!(
            "POST {path} HTTP/1.1\r\nHost: {ep}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        s.write_all(req.as_bytes()).map_err(t)?;
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).map_err(t)?;
        let split = raw
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .ok_or_else(|| Exchange::Transport("the answer has no header end".into()))?;
        let head = String::from_utf8_lossy(&raw[..split]).to_string();
        let mut payload = raw[split + 4..].to_vec();
        if head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked")
        {
            payload = dechunk(&payload).ok_or_else(|| Exchange::Answer("bad chunking".into()))?;
        }
        let status = head.split_whitespace().nth(1).unwrap_or("");
        let v: Value = serde_json::from_slice(&payload)
            .map_err(|e| Exchange::Answer(format!("status {status}, body not JSON ({e})")))?;
        if status != "200" {
            let msg = format!("status {status}: {}", v["message"].as_str().unwrap_or(""));
            // A member that cannot serve now (no leader, timeout): another one may.
            return Err(if status.starts_with('5') {
                Exchange::Transport(msg)
            } else {
                Exchange::Answer(msg)
            });
        }
        Ok(v)
    }
}

enum Exchange {
    /// The endpoint could not be reached or cut the exchange short: try the next one.
    Transport(String),
    /// The endpoint answered with an error.
    Answer(String),
}

/// A keepalive stream's answer: `result` (its TTL absent or 0 once the lease is gone), or
/// `error` (with status 200) when etcd could not serve it, which says nothing of the lease.
fn keepalive_answer(v: &Value, lease: LeaseId) -> Result<Result<Duration, CoordError>, String> {
    match (num(&v["result"]["TTL"]), v["result"].is_object()) {
        (Some(ttl), _) if ttl > 0 => Ok(Ok(Duration::from_secs(ttl as u64))),
        (_, true) => Ok(Err(CoordError::Expired(lease))),
        _ => Err(format!("keepalive of lease {lease:x} failed: {v}")),
    }
}

fn dechunk(mut b: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let eol = b.windows(2).position(|w| w == b"\r\n")?;
        let n = usize::from_str_radix(std::str::from_utf8(&b[..eol]).ok()?.trim(), 16).ok()?;
        b = &b[eol + 2..];
        if n == 0 {
            return Some(out);
        }
        out.extend_from_slice(b.get(..n)?);
        b = b.get(n + 2..)?;
    }
}

impl Coordinator for Etcd {
    fn grant(&self, ttl: Duration) -> Result<(LeaseId, Duration), CoordError> {
        let secs = ttl.as_secs_f64().ceil().max(1.0) as i64;
        let v = self.call("/v3/lease/grant", json!({ "TTL": secs.to_string() }))?;
        match (num(&v["ID"]), num(&v["TTL"])) {
            (Some(id), Some(ttl)) if id != 0 && ttl > 0 => {
                Ok((id, Duration::from_secs(ttl as u64)))
            }
            _ => Err(CoordError::Protocol {
                endpoint: self.describe(),
                what: format!("no lease in {v}"),
            }),
        }
    }

    fn keep_alive(&self, lease: LeaseId) -> Result<Duration, CoordError> {
        let v = self.call("/v3/lease/keepalive", json!({ "ID": lease.to_string() }))?;
        keepalive_answer(&v, lease).map_err(|what| CoordError::Protocol {
            endpoint: self.describe(),
            what,
        })?
    }

    fn revoke(&self, lease: LeaseId) -> Result<(), CoordError> {
        match self.call("/v3/lease/revoke", json!({ "ID": lease.to_string() })) {
            Err(CoordError::Protocol { .. }) => Ok(()), // already gone
            r => r.map(drop),
        }
    }

    fn put(&self, key: &str, value: &[u8], lease: Option<LeaseId>) -> Result<(), CoordError> {
        let r = self.call(
            "/v3/kv/put",
            json!({ "key": self.key(key), "value": B64.encode(value),
                    "lease": lease.unwrap_or(0).to_string() }),
        );
        match (r, lease) {
            (Err(CoordError::Protocol { what, .. }), Some(id))
                if what.contains("lease not found") =>
            {
                Err(CoordError::Expired(id))
            }
            (r, _) => r.map(drop),
        }
    }

    fn create(
        &self,
        key: &str,
        value: &[u8],
        lease: Option<LeaseId>,
    ) -> Result<Result<u64, Vec<u8>>, CoordError> {
        let k = self.key(key);
        let v = self.txn(
            json!({
                "compare": [{ "key": k, "target": "CREATE", "result": "EQUAL", "create_revision": "0" }],
                "success": [{ "requestPut": { "key": k, "value": B64.encode(value),
                                              "lease": lease.unwrap_or(0).to_string() } }],
                "failure": [{ "requestRange": { "key": k } }],
            }),
            lease,
        )?;
        if v["succeeded"].as_bool() == Some(true) {
            // The txn's revision is the one the key was created at.
            return num(&v["header"]["revision"])
                .map(|r| Ok(r as u64))
                .ok_or_else(|| CoordError::Protocol {
                    endpoint: self.describe(),
                    what: format!("no revision in {v}"),
                });
        }
        let held = v["responses"][0]["response_range"]["kvs"][0]["value"]
            .as_str()
            .and_then(|s| B64.decode(s).ok())
            .unwrap_or_default();
        Ok(Err(held))
    }

    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, CoordError> {
        let v = self.call("/v3/kv/range", json!({ "key": self.key(key) }))?;
        Ok(v["kvs"][0]["value"]
            .as_str()
            .map(|s| B64.decode(s).unwrap_or_default()))
    }

    fn created(&self, key: &str) -> Result<Option<(u64, Vec<u8>)>, CoordError> {
        let v = self.call("/v3/kv/range", json!({ "key": self.key(key) }))?;
        let kv = &v["kvs"][0];
        let Some(value) = kv["value"].as_str() else {
            return Ok(None);
        };
        let created = num(&kv["create_revision"]).ok_or_else(|| CoordError::Protocol {
            endpoint: self.describe(),
            what: format!("no create_revision in {v}"),
        })?;
        Ok(Some((
            created as u64,
            B64.decode(value).unwrap_or_default(),
        )))
    }

    fn write_if(&self, guard: &Guard, write: Write) -> Result<(), CoordError> {
        let (op, lease) = match &write {
            Write::Put { key, value, lease } => (
                json!({ "requestPut": { "key": self.key(key), "value": B64.encode(value),
                                        "lease": lease.unwrap_or(0).to_string() } }),
                *lease,
            ),
            Write::Delete { key } => (
                json!({ "requestDeleteRange": { "key": self.key(key) } }),
                None,
            ),
        };
        let v = self.txn(
            json!({ "compare": self.held(guard), "success": [op] }),
            lease,
        )?;
        if v["succeeded"].as_bool() == Some(true) {
            Ok(())
        } else {
            Err(CoordError::NotHeld {
                key: guard.key.clone(),
                lease: guard.lease,
            })
        }
    }

    fn holds(&self, guard: &Guard) -> Result<bool, CoordError> {
        let v = self.txn(json!({ "compare": self.held(guard) }), None)?;
        Ok(v["succeeded"].as_bool() == Some(true))
    }

    fn list(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, CoordError> {
        let full = format!("{}{prefix}", self.prefix);
        let v = self.call(
            "/v3/kv/range",
            json!({ "key": B64.encode(&full), "range_end": B64.encode(prefix_end(full.as_bytes())) }),
        )?;
        let kvs = v["kvs"].as_array().cloned().unwrap_or_default();
        Ok(kvs
            .iter()
            .filter_map(|kv| {
                let k = B64.decode(kv["key"].as_str()?).ok()?;
                let k = String::from_utf8(k).ok()?;
                let val = kv["value"]
                    .as_str()
                    .map_or(Ok(Vec::new()), |s| B64.decode(s))
                    .ok()?;
                Some((k.strip_prefix(&self.prefix)?.to_string(), val))
            })
            .collect())
    }

    fn delete(&self, key: &str) -> Result<(), CoordError> {
        self.call("/v3/kv/deleterange", json!({ "key": self.key(key) }))
            .map(drop)
    }

    fn describe(&self) -> String {
        format!("etcd {} under {}", self.endpoints.join(","), self.prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_ends_just_after_its_last_key() {
        assert_eq!(prefix_end(b"/a/"), b"/a0".to_vec());
        assert_eq!(prefix_end(b"a\xff"), b"b".to_vec());
        assert_eq!(prefix_end(b"\xff"), vec![0]);
    }

    #[test]
    fn only_a_keepalive_result_without_ttl_means_the_lease_lapsed() {
        let ok = json!({ "result": { "ID": "5", "TTL": "2" } });
        assert_eq!(
            keepalive_answer(&ok, 5).unwrap().unwrap(),
            Duration::from_secs(2)
        );
        let gone = json!({ "result": { "ID": "5" } });
        assert!(matches!(
            keepalive_answer(&gone, 5).unwrap(),
            Err(CoordError::Expired(5))
        ));
        let failed = json!({ "error": { "grpc_code": 14, "message": "etcdserver: no leader" } });
        assert!(keepalive_answer(&failed, 5)
            .unwrap_err()
            .contains("no leader"));
    }

    #[test]
    fn chunked_bodies_are_joined() {
        assert_eq!(
            dechunk(b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n").unwrap(),
            b"abcde"
        );
        assert!(dechunk(b"5\r\nab").is_none());
    }

    #[test]
    fn bad_endpoints_and_names_are_refused() {
        assert!(Etcd::new("", "c", Duration::from_secs(1)).is_err());
        assert!(Etcd::new("127.0.0.1:2379", "a/b", Duration::from_secs(1)).is_err());
        assert!(Etcd::new("http://127.0.0.1:2379/", "c", Duration::from_secs(1)).is_ok());
    }
}
