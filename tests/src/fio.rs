//! The one way tests and benchmarks run fio and read its results.
//!
//! [`Fio`] builds a command line (`--key=value` options, optionally a job file and the
//! environment it reads); fio always runs with JSON output and in a private temporary working
//! directory, so whatever it leaves there (verify state files) never lands in a checkout.
//! [`FioReport`] is the parsed result, per job.

use std::fmt::Display;
use std::path::Path;
use std::process::{Child, Command, Stdio};

use crate::process::TempDir;

/// A fio invocation (see the module docs).
#[derive(Clone, Debug, Default)]
pub struct Fio {
    job_file: Option<String>,
    args: Vec<String>,
    envs: Vec<(String, String)>,
    cpus: Option<String>,
}

impl Fio {
    /// A job named `name` on files in `dir`.
    pub fn job(name: &str, dir: &Path) -> Fio {
        Fio::default()
            .opt("name", name)
            .opt("directory", dir.display())
    }

    /// A psync, direct-I/O job writing `size` per job with crc32c checksums (`rw`: `write`,
    /// `randwrite`) and reading everything back to verify it; fio fails on the first mismatch.
    pub fn verify(name: &str, dir: &Path, rw: &str, size: &str) -> Fio {
        Fio::job(name, dir)
            .opt("rw", rw)
            .opt("bs", "4k")
            .opt("size", size)
            .opt("ioengine", "psync")
            .opt("direct", 1)
            .opt("verify", "crc32c")
            .opt("do_verify", 1)
            .opt("verify_fatal", 1)
    }

    /// The jobs of a job file; options given on the command line come after it.
    pub fn file(path: &Path) -> Fio {
        Fio {
            job_file: Some(path.display().to_string()),
            ..Fio::default()
        }
    }

    /// Adds `--key=value`.
    pub fn opt(mut self, key: &str, value: impl Display) -> Fio {
        self.args.push(format!("--{key}={value}"));
        self
    }

    /// Adds `--key`.
    pub fn flag(mut self, key: &str) -> Fio {
        self.args.push(format!("--{key}"));
        self
    }

    /// Sets an environment variable (job files read `${NAME}`).
    pub fn env(mut self, key: &str, value: impl Display) -> Fio {
        self.envs.push((key.into(), value.to_string()));
        self
    }

    /// Runs fio (all its threads) on `cpus` (a `taskset -c` list).
    pub fn pinned(mut self, cpus: impl Display) -> Fio {
        self.cpus = Some(cpus.to_string());
        self
    }

    /// Starts fio.
    pub fn spawn(&self) -> FioRun {
        let cwd = TempDir::new("fio");
        let mut cmd = match &self.cpus {
            Some(c) => {
                let mut t = Command::new("taskset");
                t.args(["-c", c, "fio"]);
                t
            }
            None => Command::new("fio"),
        };
        cmd.args(&self.job_file)
            .args(&self.args)
            .arg("--output-format=json")
            .envs(self.envs.iter().map(|(k, v)| (k, v)))
            .current_dir(cwd.path())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let child = cmd.spawn().unwrap_or_else(|e| {
            panic!("run fio (scripts/test installs it: apt-get install fio): {e}")
        });
        FioRun {
            child,
            args: self.args.join(" "),
            interrupted: false,
            _cwd: cwd,
        }
    }

    /// Runs fio to the end; panics with fio's own message if it fails.
    pub fn run(&self) -> FioReport {
        self.spawn().wait()
    }
}

/// A running fio.
pub struct FioRun {
    child: Child,
    args: String,
    /// Ended early by [`FioRun::interrupt`].
    interrupted: bool,
    _cwd: TempDir,
}

impl FioRun {
    /// Whether fio is still running.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Ends a time-based run early, as Ctrl-C would: fio stops its jobs and still reports
    /// (with `verify_backlog`, what it wrote so far was verified as it went). Its exit status
    /// may then say it was cut short: the report's per-job errors are what count.
    pub fn interrupt(&mut self) {
        // SAFETY: kill(2) of our own child, not yet reaped (so its pid is still ours).
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
        self.interrupted = true;
    }

    /// Waits for fio and parses its report; panics with fio's own message if it failed.
    pub fn wait(self) -> FioReport {
        self.finish().unwrap_or_else(|e| panic!("{e}"))
    }

    /// Waits for fio and parses its report; fio's own message if it failed.
    pub fn finish(self) -> Result<FioReport, String> {
        let out = self.child.wait_with_output().expect("wait for fio");
        if !out.status.success() && !self.interrupted {
            return Err(format!(
                "fio {} failed: {}{}",
                self.args,
                String::from_utf8_lossy(&out.stderr),
                String::from_utf8_lossy(&out.stdout)
            ));
        }
        FioReport::parse(&out.stdout).map_err(|e| format!("fio {}: {e}", self.args))
    }
}

/// One direction of one job.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct FioSide {
    pub iops: f64,
    pub bw_bytes: f64,
    pub io_bytes: u64,
    /// Completion-latency percentiles, microseconds.
    pub p50_us: f64,
    pub p99_us: f64,
}

/// One job (or, with `group_reporting`, one group).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FioJob {
    pub name: String,
    /// fio's error number for the job (0: none).
    pub error: i64,
    pub read: FioSide,
    pub write: FioSide,
}

impl FioJob {
    /// The busier direction (by IOPS).
    pub fn main_side(&self) -> &FioSide {
        if self.read.iops >= self.write.iops {
            &self.read
        } else {
            &self.write
        }
    }
}

/// fio's JSON report.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FioReport {
    pub jobs: Vec<FioJob>,
}

impl FioReport {
    /// Parses `--output-format=json` output. fio may print warnings before the JSON: they are
    /// skipped.
    pub fn parse(out: &[u8]) -> Result<FioReport, String> {
        let start = out
            .iter()
            .position(|&b| b == b'{')
            .ok_or("no JSON in fio's output")?;
        let v: serde_json::Value =
            serde_json::from_slice(&out[start..]).map_err(|e| format!("fio JSON: {e}"))?;
        let side = |j: &serde_json::Value| {
            let pct = |p: &str| j["clat_ns"]["percentile"][p].as_f64().unwrap_or(0.0) / 1e3;
            FioSide {
                iops: j["iops"].as_f64().unwrap_or(0.0),
                bw_bytes: j["bw_bytes"].as_f64().unwrap_or(0.0),
                io_bytes: j["io_bytes"].as_u64().unwrap_or(0),
                p50_us: pct("50.000000"),
                p99_us: pct("99.000000"),
            }
        };
        let jobs = v["jobs"]
            .as_array()
            .ok_or("fio JSON has no jobs")?
            .iter()
            .map(|j| FioJob {
                name: j["jobname"].as_str().unwrap_or("?").to_string(),
                error: j["error"].as_i64().unwrap_or(0),
                read: side(&j["read"]),
                write: side(&j["write"]),
            })
            .collect();
        Ok(FioReport { jobs })
    }

    /// The first job (fio with `group_reporting` reports one).
    pub fn first(&self) -> &FioJob {
        self.jobs.first().expect("fio reported no job")
    }

    /// IOPS of every job together.
    pub fn total_iops(&self) -> f64 {
        self.jobs.iter().map(|j| j.read.iops + j.write.iops).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_jobs_and_skips_warnings() {
        let out = br#"fio: some warning
{"jobs": [{"jobname": "a", "error": 0,
  "read": {"iops": 10.5, "bw_bytes": 43008, "io_bytes": 4096,
           "clat_ns": {"percentile": {"50.000000": 2000, "99.000000": 9000}}},
  "write": {"iops": 0, "bw_bytes": 0, "io_bytes": 0}},
 {"jobname": "b", "error": 5, "read": {}, "write": {"iops": 3}}]}"#;
        let r = FioReport::parse(out).unwrap();
        assert_eq!(r.jobs.len(), 2);
        assert_eq!(r.first().read.iops, 10.5);
        assert_eq!(r.first().read.p99_us, 9.0);
        assert_eq!(r.jobs[1].error, 5);
        assert_eq!(r.jobs[1].main_side().iops, 3.0);
        assert_eq!(r.total_iops(), 13.5);
        assert!(FioReport::parse(b"no json").is_err());
        assert!(FioReport::parse(b"{\"x\": 1}").is_err());
    }
}
