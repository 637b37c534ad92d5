//! The systemd units of `dist/systemd` and the example configuration of `dist/etc`: systemd
//! accepts the units (`systemd-analyze verify`, when the machine has it), the memory node's
//! unit starts a node from a configuration file as systemd would, and the example's flags
//! exist; `scripts/deb` packages them with the binaries.
#![deny(clippy::undocumented_unsafe_blocks)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use rackfs_tests::{bin_path, TempDir};

fn dist() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../dist")
}

const UNITS: [&str; 3] = [
    "rackfs-memnode@.service",
    "rackfs-etcd.service",
    "mnt-rackfs.mount",
];

fn unit(name: &str) -> String {
    std::fs::read_to_string(dist().join("systemd").join(name))
        .unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// `key=` values of a unit's lines (continuation lines joined).
fn values(text: &str, key: &str) -> Vec<String> {
    let joined = text.replace("\\\n", " ");
    joined
        .lines()
        .filter_map(|l| l.strip_prefix(&format!("{key}=")))
        .map(str::to_string)
        .collect()
}

fn has(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join(name))
            .find(|f| f.is_file())
    })
}

/// `systemd-analyze verify` accepts every unit (and an instance of the template), with the
/// binaries they name pointed at this build; skipped, saying so, where systemd is not
/// installed.
#[test]
fn systemd_analyze_verifies_every_unit() {
    let Some(analyze) = has("systemd-analyze") else {
        eprintln!("SKIPPED: systemd-analyze is not installed (Debian: apt-get install systemd)");
        return;
    };
    let dir = TempDir::new("units");
    let memnode = bin_path("rackfs-memnode");
    // etcd may be missing here: any executable stands in for it (verify checks it exists).
    let etcd = Path::new("/usr/bin/etcd");
    let etcd = if etcd.exists() {
        etcd.to_path_buf()
    } else {
        eprintln!("/usr/bin/etcd is missing: rackfs-etcd.service is checked with /bin/true");
        PathBuf::from("/bin/true")
    };
    let mut files = Vec::new();
    for name in UNITS {
        let text = unit(name)
            .replace(
                "/usr/local/bin/rackfs-memnode",
                &memnode.display().to_string(),
            )
            .replace("/usr/bin/etcd", &etcd.display().to_string());
        std::fs::write(dir.path().join(name), &text).unwrap();
        files.push(dir.path().join(name));
        if name.ends_with("@.service") {
            let instance = name.replace("@.", "@mn1.");
            std::fs::write(dir.path().join(&instance), &text).unwrap();
            files.push(dir.path().join(instance));
        }
    }
    let out = Command::new(&analyze)
        .args(["verify", "--man=no"])
        .args(&files)
        .output()
        .unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "systemd-analyze verify: {said}");
    // Warnings (an unknown key, a key in the wrong section) do not fail verify: none is left.
    let ours: Vec<&str> = said
        .lines()
        .filter(|l| UNITS.iter().any(|u| l.contains(u)) || l.contains("rackfs-memnode@mn1"))
        .collect();
    assert!(
        ours.is_empty(),
        "systemd-analyze verify: {}",
        ours.join("\n")
    );
    eprintln!(
        "systemd-analyze verify: {} unit files accepted",
        files.len()
    );
}

/// What an operator expects of the units: memory locking unlimited, restarts on failure after
/// a pause longer than a node lease, ordered after the network, root, and a mount unit whose
/// file name matches its mount point.
#[test]
fn the_units_set_what_an_operator_expects() {
    let memnode = unit("rackfs-memnode@.service");
    for (key, want) in [
        ("LimitMEMLOCK", "infinity"),
        ("Restart", "on-failure"),
        ("RestartSec", "5s"),
        ("User", "root"),
        ("EnvironmentFile", "/etc/rackfs/memnode-%i.conf"),
        ("After", "network-online.target rackfs-etcd.service"),
    ] {
        assert_eq!(values(&memnode, key), [want], "{key}");
    }
    let etcd = unit("rackfs-etcd.service");
    assert_eq!(values(&etcd, "StateDirectory"), ["rackfs/etcd"]);
    assert!(values(&etcd, "ExecStart")[0].contains("--data-dir /var/lib/rackfs/etcd"));
    let mount = unit("mnt-rackfs.mount");
    assert_eq!(values(&mount, "Where"), ["/mnt/rackfs"]);
    assert_eq!(values(&mount, "Type"), ["rackfs"]);
    assert!(values(&mount, "Options")[0].starts_with("_netdev,"));
}

/// The `MEMNODE_ARGS="..."` lines of a configuration file, commented-out examples included,
/// as systemd splits them (on spaces).
fn memnode_args(conf: &str) -> Vec<Vec<String>> {
    conf.lines()
        .map(|l| l.trim_start_matches('#'))
        .filter_map(|l| l.strip_prefix("MEMNODE_ARGS="))
        .map(|v| {
            v.trim_matches('"')
                .split_whitespace()
                .map(str::to_string)
                .collect()
        })
        .collect()
}

/// The memory node's unit starts a node as systemd would run it: its `ExecStart` with `%i` the
/// instance and `$MEMNODE_ARGS` from the configuration file, split on spaces.
#[test]
fn the_memnode_unit_starts_a_node_from_its_configuration_file() {
    let dir = TempDir::new("unit-run");
    let secret = dir.path().join("secret");
    std::fs::write(&secret, rackfs_verbs::Secret::generate().expose()).unwrap();
    let conf = format!(
        "# as in /etc/rackfs/memnode-mn7.conf\nMEMNODE_ARGS=\"--primary --node-id 7 --listen 127.0.0.1:0 --region 16M --secret-file {}\"\n",
        secret.display()
    );
    let args = &memnode_args(&conf)[0];
    let exec = &values(&unit("rackfs-memnode@.service"), "ExecStart")[0];
    let mut words = exec.split_whitespace();
    assert_eq!(words.next(), Some("/usr/local/bin/rackfs-memnode"));
    let mut argv: Vec<String> = Vec::new();
    for w in words {
        match w {
            "$MEMNODE_ARGS" => argv.extend(args.iter().cloned()),
            w => argv.push(w.replace("%i", "mn7")),
        }
    }
    let mut child = Command::new(bin_path("rackfs-memnode"))
        .args(&argv)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    assert!(
        line.starts_with("rackfs-memnode ready: node=7 "),
        "{argv:?}: {line:?} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(
        log.lines()
            .any(|l| l.contains("memory node serving") && l.contains("mn7")),
        "the instance names the node: {log}"
    );
}

/// Every flag of the example configuration exists, and no example repeats `--name` (the unit
/// passes the instance).
#[test]
fn the_example_configuration_uses_only_real_flags() {
    let conf = std::fs::read_to_string(dist().join("etc/memnode.conf.example")).unwrap();
    let examples = memnode_args(&conf);
    assert!(examples.len() >= 3, "{examples:?}");
    let help = Command::new(bin_path("rackfs-memnode"))
        .arg("--help")
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    for args in &examples {
        assert!(!args.contains(&"--name".to_string()), "{args:?}");
        for flag in args.iter().filter(|a| a.starts_with("--")) {
            assert!(help.contains(&format!("{flag} ")), "{flag} is no flag");
        }
    }
}

/// `scripts/deb` packages what `scripts/install` installs (with `PREFIX=/usr`): the package
/// names itself and its dependencies, marks the configuration as a conffile, and holds working
/// binaries, man pages, completions and units where Debian looks for them.
#[test]
fn the_debian_package_holds_what_scripts_install_installs() {
    if has("dpkg-deb").is_none() {
        eprintln!("SKIPPED: dpkg-deb is not installed (Debian: apt-get install dpkg)");
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = Command::new(root.join("scripts/deb"))
        .env("PROFILE", "debug")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let deb = root.join(String::from_utf8(out.stdout).unwrap().trim());
    let field = |f: &str| {
        let out = Command::new("dpkg-deb")
            .arg("-f")
            .arg(&deb)
            .arg(f)
            .output()
            .unwrap();
        String::from_utf8(out.stdout).unwrap().trim().to_string()
    };
    assert_eq!(field("Package"), "rackfs");
    assert_eq!(field("Version"), env!("CARGO_PKG_VERSION"));
    assert!(
        field("Depends").starts_with("libc6 (>= "),
        "{}",
        field("Depends")
    );
    assert_eq!(field("Recommends"), "fuse3");
    let tmp = TempDir::new("deb");
    let x = Command::new("dpkg-deb")
        .arg("-x")
        .arg(&deb)
        .arg(tmp.path())
        .status()
        .unwrap();
    assert!(x.success());
    for f in [
        "usr/bin/rackfs",
        "usr/bin/rackfs-memnode",
        "sbin/mount.rackfs",
        "usr/share/man/man1/rackfs.1.gz",
        "usr/share/man/man1/rackfs-up.1.gz",
        "usr/share/man/man1/rackfs-memnode.1.gz",
        "usr/share/bash-completion/completions/rackfs",
        "usr/share/zsh/site-functions/_rackfs",
        "usr/share/fish/vendor_completions.d/rackfs.fish",
        "usr/lib/systemd/system/rackfs-memnode@.service",
        "usr/lib/systemd/system/rackfs-etcd.service",
        "usr/share/doc/rackfs/copyright",
        "etc/rackfs/memnode.conf.example",
    ] {
        assert!(tmp.path().join(f).is_file(), "the package lacks /{f}");
    }
    // The units name the binaries where the package puts them.
    let memnode_unit = std::fs::read_to_string(
        tmp.path()
            .join("usr/lib/systemd/system/rackfs-memnode@.service"),
    )
    .unwrap();
    assert!(
        memnode_unit.contains("/usr/bin/rackfs-memnode"),
        "{memnode_unit}"
    );
    assert!(!memnode_unit.contains("/usr/local/"), "{memnode_unit}");
    let version = Command::new(tmp.path().join("usr/bin/rackfs"))
        .arg("--version")
        .output()
        .unwrap();
    assert!(version.status.success(), "{version:?}");
    assert!(String::from_utf8_lossy(&version.stdout).contains(env!("CARGO_PKG_VERSION")));
    // The configuration is the administrator's: dpkg keeps their edits.
    let control = Command::new("dpkg-deb")
        .arg("-I")
        .arg(&deb)
        .arg("conffiles")
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&control.stdout).trim(),
        "/etc/rackfs/memnode.conf.example"
    );
}
