//! A window of the agent's recorder or of a store as a report: the devices selected, per
//! cgroup where asked, with the slowest IOs of its minutes and where it was read.

use std::{collections::BTreeMap, path::Path};

use anyhow::Result;

use crate::{
    model::capture::Capture, model::cgroups::LabelForm, model::selection::Selection,
    model::topology::Topology, serve::api,
};

use super::*;

/// Where a window was read: the agent's socket, or a store's directory (offline).
#[derive(Clone, Copy, Debug)]
pub enum Origin<'a> {
    Agent(&'a Path),
    Store(&'a Path),
}

const NO_CGROUP_SERIES: &str = "--by cgroup: the agent keeps no per-cgroup series (set [cgroups] label in \
     its config); report the present with --standalone --duration SECS --by cgroup";

/// A window of the agent's recorder as a report of the devices selected (`top`), per cgroup
/// too when the window has them.
pub fn window_report_for(w: api::WindowAnswer, selection: &Selection, socket: &Path) -> Result<Report> {
    let by_cgroup = (!w.by_cgroup.is_empty()).then_some(LabelForm::Path);
    window_report(w, View { by_cgroup, ..View::default() }, None, selection, Origin::Agent(socket), None)
}

/// A window of the agent's recorder (or a store) as a report of the devices selected (and
/// saved), with their slowest IOs of the window's minutes where they were asked for.
pub fn window_report(
    w: api::WindowAnswer,
    view: View,
    save: Option<&Path>,
    selection: &Selection,
    origin: Origin,
    slowest: Option<Vec<crate::model::slowest::SlowMinute>>,
) -> Result<Report> {
    let mut capture = w.capture;
    select_devices(&mut capture, selection)?;
    if let Some(path) = save {
        capture.save(path)?;
        tracing::info!("capture saved to {}", path.display());
    }
    let (agg, topo, lost) = capture.to_aggregate();
    let mut report =
        Report::build_with(&agg, &topo, &lost, &[], &capture.kernel, capture.duration_s, view.hist);
    if view.by_cgroup.is_some() {
        if w.by_cgroup.is_empty() && !capture.devices.is_empty() {
            anyhow::bail!("{NO_CGROUP_SERIES}");
        }
        let mut aggs = BTreeMap::new();
        for (label, mut c) in w.by_cgroup {
            select_devices(&mut c, selection)?;
            aggs.insert(label, c.to_aggregate().0);
        }
        report = report.with_cgroups(&aggs, &topo, view.hist);
    }
    if let Some(slowest) = slowest {
        let shown: Vec<&str> = capture.devices.iter().map(|d| d.device.as_str()).collect();
        report.slowest = slowest.into_iter().filter(|m| shown.contains(&m.device.as_str())).collect();
    }
    let (socket, store) = match origin {
        Origin::Agent(p) => (Some(p.to_owned()), None),
        Origin::Store(p) => (None, Some(p.to_owned())),
    };
    report.from_agent = Some(FromAgent {
        socket,
        store,
        from_unix_s: w.from_unix_s,
        to_unix_s: w.to_unix_s,
        frames: w.frames,
        gaps: w.gaps,
        damaged_frames: w.damaged_frames,
    });
    Ok(report)
}

/// Keeps the devices `--device` names (with the devices below them) and drops excluded ones.
/// A name neither in the window nor on the host is an error, as when tracing.
fn select_devices(capture: &mut Capture, selection: &Selection) -> Result<()> {
    let strip = |n: &str| n.strip_prefix("/dev/").unwrap_or(n).to_owned();
    let excluded = |n: &str| selection.exclude.iter().any(|p| crate::model::selection::name_matches(p, n));
    if !selection.names.is_empty() {
        let host = Topology::scan().unwrap_or_default();
        let mut keep: Vec<String> = Vec::new();
        // Names as people type them (dm names, /dev/mapper/..., links) to the kernel's.
        let mut todo: Vec<String> = selection
            .names
            .iter()
            .map(|n| host.find(n).map_or_else(|| strip(n), |d| d.name.clone()))
            .collect();
        for name in &todo {
            if !capture.devices.iter().any(|d| &d.device == name) && host.by_name(name).is_none() {
                let mut known: Vec<String> = capture.devices.iter().map(|d| d.device.clone()).collect();
                known.extend(host.names());
                known.sort();
                known.dedup();
                anyhow::bail!(
                    "unknown block device '{name}': it is neither on this host nor in the window. Known devices: {}.",
                    known.join(", ")
                );
            }
        }
        while let Some(name) = todo.pop() {
            if keep.contains(&name) {
                continue;
            }
            if let Some(d) = capture.devices.iter().find(|d| d.device == name) {
                todo.extend(d.lowers.iter().cloned());
            }
            keep.push(name);
        }
        capture.devices.retain(|d| keep.contains(&d.device));
    }
    capture.devices.retain(|d| !excluded(&d.device));
    Ok(())
}
