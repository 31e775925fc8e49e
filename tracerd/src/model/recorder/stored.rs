//! The recorder's store: what a device is to it (a name the frames use, kept as JSON), and the
//! store attached to the recorder, the devices it names decoded once.

use crate::model::topology::Device;
use crate::store::{Store, StoredName};

use super::Recorder;

impl StoredName for Device {
    fn key(&self) -> u32 {
        self.dev
    }

    fn encode(names: &[&Device]) -> Vec<u8> {
        serde_json::to_vec(names).expect("devices encode")
    }

    fn decode(payload: &[u8]) -> Option<Vec<Device>> {
        serde_json::from_slice(payload).ok()
    }
}

impl Recorder {
    /// Writes every frame pushed from now on to `store` too, and reads windows older than the
    /// frames in memory from it.
    pub fn attach_store(&mut self, mut store: Store) {
        self.stored_devices = store.take_names();
        self.store = Some(store);
    }

    pub fn store(&self) -> Option<&Store> {
        self.store.as_ref()
    }

    pub fn store_mut(&mut self) -> Option<&mut Store> {
        self.store.as_mut()
    }
}

#[cfg(test)]
mod tests {
    use super::super::{FrameBuilder, RecorderLimits, testing::request};
    use super::*;
    use crate::model::{aggregate::Lost, op::Op};
    use crate::store::{StoreHealth, StoreLimits};

    fn device() -> Device {
        Device { name: "loop7".into(), dev: 7 << 20, disk: "loop7".into(), ..Default::default() }
    }

    #[test]
    fn frames_and_the_devices_they_name_read_back_from_the_store() {
        let d = std::env::temp_dir().join(format!("tracerd-recorder-store-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        let mut rec = Recorder::new(RecorderLimits::default());
        rec.attach_store(Store::open(StoreLimits::new(d.clone())).unwrap());
        let mut b = FrameBuilder::default();
        for s in 0..3 {
            b.add_record(7 << 20, Op::Read, &request(1000, 2000, 9000, 4096, 1), &[]);
            rec.push(b.seal(s * 1000, s * 1000 + 1000, &Lost::default()), [device()]);
        }
        drop(rec);
        let mut rec = Recorder::default();
        rec.attach_store(Store::open_read_only(&d).unwrap());
        let w = rec.window(0, u64::MAX);
        assert_eq!(w.topology.devices().collect::<Vec<_>>(), vec![&device()]);
        let (agg, _) = w.aggregate().unwrap();
        assert_eq!(agg.series[&(7 << 20, Op::Read)].requests, 3);
        assert_eq!(rec.store().unwrap().health, StoreHealth::default());
        std::fs::remove_dir_all(&d).unwrap();
    }
}
