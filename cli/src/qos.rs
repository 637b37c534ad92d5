//! `rackfs qos set`: change a live mount's QoS (reservation, limit, weight).

use std::path::Path;

use rackfs_fs::mount::MountRecord;
use rackfs_proto::control::{ControlRequest, ControlResponse};
use rackfs_proto::ControlClient;
use rackfs_verbs::Secret;

use crate::error::CliError;
use crate::outln;

/// `rackfs qos set`: the mount's slot comes from its state file, the cluster from its source.
pub fn qos_set(mountpoint: &Path, settings: &str) -> Result<(), CliError> {
    let dir = std::fs::canonicalize(mountpoint).map_err(|err| CliError::Path {
        path: mountpoint.into(),
        err,
    })?;
    let Some((_, source)) = rackfs_fs::mount::mount_type(&dir)
        .filter(|(fstype, _)| rackfs_fs::mount::is_rackfs_mount(&dir) || fstype.contains("rackfs"))
    else {
        return Err(CliError::NotRackfs(dir));
    };
    let Some(record) = MountRecord::read(&dir) else {
        return Err(CliError::NoRecord {
            path: dir,
            hint: " (was it mounted by another host's rackfs?)",
        });
    };
    let Some(slot) = record.qos_slot else {
        return Err(CliError::QosOff(dir));
    };
    let secret = Secret::from_file(&record.secret_file)?;
    let addr = source
        .trim_start_matches("rackfs:")
        .split(',')
        .next()
        .unwrap_or("")
        .to_string();
    let c =
        ControlClient::connect(&addr, &secret, "rackfs-qos").map_err(|err| CliError::Cluster {
            what: format!("the cluster of {} ({addr})", dir.display()),
            err,
        })?;
    let current = match c.call(&ControlRequest::QosStatus)? {
        ControlResponse::QosStatus(q) => q.mounts.into_iter().find(|m| m.slot == slot),
        other => return Err(CliError::Reply(format!("to QoS status: {other:?}"))),
    }
    .ok_or(CliError::NoQosSlot(slot))?;
    let (mut reservation, mut limit, mut weight) =
        (current.reservation, current.limit, current.weight);
    for item in settings.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let (k, v) = item
            .split_once('=')
            .ok_or_else(|| CliError::Settings(format!("{item:?}: expected key=value")))?;
        let iops = || {
            rackfs_fs::options::parse_iops(v)
                .ok_or_else(|| CliError::Settings(format!("{k}={v}: expected IOPS")))
        };
        match k {
            "reservation" => reservation = iops()?,
            "limit" => limit = iops()?,
            "weight" => {
                weight = v
                    .parse()
                    .ok()
                    .filter(|w| (1..=10_000).contains(w))
                    .ok_or_else(|| {
                        CliError::Settings(format!("weight={v}: expected a number from 1 to 10000"))
                    })?
            }
            _ => {
                return Err(CliError::Settings(format!(
                    "unknown QoS setting {k:?} (reservation, limit, weight)"
                )))
            }
        }
    }
    match c.call(&ControlRequest::QosSet {
        slot: Some(slot),
        reservation,
        limit,
        weight,
    }) {
        Ok(ControlResponse::QosGranted { .. }) => {
            outln!(
                "{}: reservation {reservation} IOPS, limit {}, weight {weight}",
                dir.display(),
                if limit == 0 {
                    "none".to_string()
                } else {
                    format!("{limit} IOPS")
                }
            );
            Ok(())
        }
        Ok(other) => Err(CliError::Reply(format!("{other:?}"))),
        Err(e) => Err(e.into()),
    }
}
