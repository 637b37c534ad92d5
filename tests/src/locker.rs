//! `rackfs-locker` processes: take `fcntl` and `flock` locks on command (see that binary's
//! docs), for the record-lock tests.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError};
use std::time::Duration;

use crate::process::bin_path;

/// One `rackfs-locker` process.
pub struct Locker {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    pub pid: u32,
}

impl Locker {
    pub fn spawn() -> Locker {
        let mut child = Command::new(bin_path("rackfs-locker"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn rackfs-locker");
        let out = child.stdout.take().expect("stdout");
        let (tx, lines) = channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines() {
                let Ok(l) = l else { break };
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        let pid = child.id();
        Locker {
            stdin: child.stdin.take(),
            child,
            lines,
            pid,
        }
    }

    pub fn send(&mut self, cmd: &str) {
        let stdin = self.stdin.as_mut().expect("locker running");
        writeln!(stdin, "{cmd}").expect("locker stdin");
        stdin.flush().expect("locker stdin");
    }

    pub fn answer(&self, within: Duration) -> Option<String> {
        match self.lines.recv_timeout(within) {
            Ok(l) => Some(l),
            Err(RecvTimeoutError::Timeout) => None,
            Err(RecvTimeoutError::Disconnected) => Some("(exited)".into()),
        }
    }

    /// Sends `cmd` and waits up to 10 s for its answer.
    pub fn ask(&mut self, cmd: &str) -> String {
        self.send(cmd);
        self.answer(Duration::from_secs(10))
            .unwrap_or_else(|| format!("no answer to {cmd:?} in 10 s"))
    }

    /// Ends the process (its descriptors close, as at any exit).
    pub fn exit(&mut self) {
        drop(self.stdin.take());
        let _ = self.child.wait();
    }
}

impl Drop for Locker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
