//! `mount.rackfs`: the helper mount(8) runs for `mount -t rackfs` and `/etc/fstab` entries.
//!
//! Called as `mount.rackfs SOURCE DIR [-sfnv] [-o OPTIONS] [-t TYPE]`. Installed as
//! `/sbin/mount.rackfs` (see `scripts/install`); built as `mount-rackfs` because Cargo does not
//! allow dots in binary names. Options are RackFS mount options; mount(8)'s generic ones
//! (`_netdev`, `defaults`, `rw`, ...) are accepted and ignored.

use std::path::PathBuf;
use std::process::ExitCode;

/// What mount(8) asked for.
#[derive(Debug, PartialEq)]
struct Invocation {
    source: String,
    dir: PathBuf,
    options: String,
    fake: bool,
    foreground: bool,
}

fn parse(args: &[String]) -> Result<Invocation, String> {
    let mut positional = Vec::new();
    let mut options = Vec::new();
    let (mut fake, mut foreground) = (false, false);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "-o" => options.push(it.next().ok_or("-o needs an option list")?.clone()),
            "-t" => {
                it.next().ok_or("-t needs a type")?;
            }
            "--foreground" => foreground = true,
            s if s.starts_with("-o") && s.len() > 2 => options.push(s[2..].to_string()),
            s if s.starts_with('-')
                && s.len() > 1
                && s[1..].chars().all(|c| "sfnvrw".contains(c)) =>
            {
                fake |= s.contains('f');
                if s.contains('r') {
                    options.push("ro".into());
                }
            }
            s if s.starts_with('-') => return Err(format!("unknown flag {s}")),
            _ => positional.push(a.clone()),
        }
    }
    match positional.as_slice() {
        [source, dir] => Ok(Invocation {
            source: source.clone(),
            dir: PathBuf::from(dir),
            options: options.join(","),
            fake,
            foreground,
        }),
        _ => Err("usage: mount.rackfs HOST:PORT[,HOST:PORT...] DIR [-o OPTIONS]".into()),
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let inv = match parse(&args) {
        Ok(i) => i,
        Err(e) => {
            complain(&e);
            return ExitCode::from(1);
        }
    };
    if inv.fake {
        return ExitCode::SUCCESS;
    }
    let exe = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("mount.rackfs"));
    let fwd = vec![
        inv.source.clone(),
        inv.dir.display().to_string(),
        "-o".into(),
        inv.options.clone(),
        "--foreground".into(),
    ];
    match rackfs_fs::mount::mount_command(
        &inv.source,
        &inv.dir,
        &inv.options,
        inv.foreground,
        &exe,
        fwd,
    ) {
        Ok(Some(daemon)) => say(&daemon),
        Ok(None) => ExitCode::SUCCESS,
        Err(e) => {
            complain(&e);
            // mount(8) convention: 32 = mount failure.
            ExitCode::from(32)
        }
    }
}

/// Prints the line about a mount left serving. The mount is up either way, so a reader that
/// went away (or any other failure to write it) is no failure of the mount: status 0, quietly,
/// rather than `println!`'s panic.
fn say(line: &impl std::fmt::Display) -> ExitCode {
    use std::io::Write;
    let _ = writeln!(std::io::stdout(), "{line}");
    ExitCode::SUCCESS
}

/// Reports a failure on stderr; one that cannot be written is dropped (no panic).
fn complain(e: &dyn std::fmt::Display) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "mount.rackfs: {e}");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn parses_what_mount_passes() {
        let i = parse(&args("127.0.0.1:7070 /mnt/r -o rw,_netdev,secret_file=/s")).unwrap();
        assert_eq!(i.source, "127.0.0.1:7070");
        assert_eq!(i.dir, PathBuf::from("/mnt/r"));
        assert_eq!(i.options, "rw,_netdev,secret_file=/s");
        assert!(!i.fake);
        let i = parse(&args("a:1,b:2 /m -n -v -o x=1 -t rackfs -o y")).unwrap();
        assert_eq!(i.options, "x=1,y");
        assert!(parse(&args("a:1 /m -f")).unwrap().fake);
        assert!(parse(&args("a:1 /m -r")).unwrap().options.contains("ro"));
        assert!(parse(&args("a:1")).is_err());
        assert!(parse(&args("a:1 /m -Z"))
            .unwrap_err()
            .contains("unknown flag"));
        assert!(parse(&args("a:1 /m -o")).is_err());
    }
}
