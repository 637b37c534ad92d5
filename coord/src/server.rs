//! A single-member etcd on loopback, for `rackfs up --etcd` and the tests: Debian's
//! `etcd-server` started on free ports with its data in a directory of the caller's.

use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::{Coordinator, Etcd};

/// Why a local etcd did not start.
#[derive(Debug, thiserror::Error)]
pub enum EtcdStartError {
    #[error("cannot run {bin}: {err} (install Debian's etcd-server: apt-get install etcd-server)")]
    Spawn { bin: String, err: std::io::Error },
    #[error("cannot pick a free port: {0}")]
    Port(std::io::Error),
    #[error("etcd did not answer within {secs} s; its log: {log}")]
    NotReady { secs: u64, log: String },
}

/// A running etcd (killed on drop unless [`EtcdServer::detach`]ed).
pub struct EtcdServer {
    child: Option<Child>,
    endpoint: String,
    log: PathBuf,
}

fn free_port() -> Result<u16, EtcdStartError> {
    let l = TcpListener::bind("127.0.0.1:0").map_err(EtcdStartError::Port)?;
    Ok(l.local_addr().map_err(EtcdStartError::Port)?.port())
}

/// The etcd binary: `$RACKFS_ETCD`, else `etcd` on the path.
pub fn etcd_binary() -> String {
    std::env::var("RACKFS_ETCD").unwrap_or_else(|_| "etcd".into())
}

impl EtcdServer {
    /// Starts etcd with its data and log in `dir`, and waits until it answers.
    pub fn start(dir: &Path) -> Result<EtcdServer, EtcdStartError> {
        let (client, peer) = (free_port()?, free_port()?);
        let endpoint = format!("127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let log = dir.join("etcd.log");
        let out = std::fs::File::create(&log).map_err(|err| EtcdStartError::Spawn {
            bin: log.display().to_string(),
            err,
        })?;
        let bin = etcd_binary();
        let mut cmd = Command::new(&bin);
        // SAFETY: the closure only calls prctl(2), which is async-signal-safe, between fork
        // and exec: etcd goes when the process that started it does.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd
            .arg("--name=rackfs")
            .arg(format!("--data-dir={}", dir.join("etcd-data").display()))
            .arg(format!("--listen-client-urls=http://{endpoint}"))
            .arg(format!("--advertise-client-urls=http://{endpoint}"))
            .arg(format!("--listen-peer-urls={peer_url}"))
            .arg(format!("--initial-advertise-peer-urls={peer_url}"))
            .arg(format!("--initial-cluster=rackfs={peer_url}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(out)
            .spawn()
            .map_err(|err| EtcdStartError::Spawn { bin, err })?;
        let mut s = EtcdServer {
            child: Some(child),
            endpoint,
            log,
        };
        let probe = Etcd::new(&s.endpoint, "probe", Duration::from_millis(500)).expect("valid");
        let end = Instant::now() + Duration::from_secs(20);
        while probe.get("ready").is_err() {
            let exited = s.child.as_mut().and_then(|c| c.try_wait().ok().flatten());
            if Instant::now() > end || exited.is_some() {
                return Err(EtcdStartError::NotReady {
                    secs: 20,
                    log: std::fs::read_to_string(&s.log).unwrap_or_default(),
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(s)
    }

    /// `host:port` of its client listener.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// Leaves it running after this value is dropped; returns its pid.
    pub fn detach(mut self) -> u32 {
        self.child.take().map_or(0, |c| c.id())
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
