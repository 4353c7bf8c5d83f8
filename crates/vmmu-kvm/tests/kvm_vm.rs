//! The VM harness on `/dev/kvm`: guests with 2 MiB and 1 GiB identity maps both run, write
//! what they are told, and the writes show up in the dirty log. Skipped where `/dev/kvm` is
//! not usable.

use vmmu::host::backing::Backing;
use vmmu_kvm::oracle::iter_ones;
use vmmu_kvm::{GuestPageSize, KvmVm, VmSetup, KVM_MEM_LOG_DIRTY_PAGES, TEST_MEM_GPA};

fn guest_pages_2m_run_the_write_list_guest() {
    write_list_guest(GuestPageSize::Size2M)
}

fn guest_pages_1g_run_the_write_list_guest() {
    write_list_guest(GuestPageSize::Size1G)
}

fn write_list_guest(size: GuestPageSize) {
    {
        let setup = VmSetup {
            vcpus: 2,
            window: 3 << 30,
            page_size: Some(size),
            ..Default::default()
        };
        let mut vm = KvmVm::new(&setup).unwrap_or_else(|e| panic!("{size:?}: {e}"));
        assert_eq!(vm.guest_page_size(), size);
        // Two slots far apart: one at the start of the window, one 2 GiB + 2 MiB in.
        let far = TEST_MEM_GPA + (2 << 30) + (2 << 20);
        vm.add_memslot(
            1,
            TEST_MEM_GPA,
            4 << 20,
            Backing::Anonymous,
            KVM_MEM_LOG_DIRTY_PAGES,
        )
        .unwrap();
        vm.add_memslot(
            7,
            far,
            1 << 20,
            Backing::AnonymousThp,
            KVM_MEM_LOG_DIRTY_PAGES,
        )
        .unwrap();
        let writes = [
            TEST_MEM_GPA,
            TEST_MEM_GPA + (2 << 20) + 4096 + 8,
            far + 255 * 4096,
        ];
        vm.run_writes(1, &writes, 0xfeed).unwrap();
        vm.run_writes(0, &writes[..1], 0xbeef).unwrap();
        assert_eq!(vm.read_u64(writes[0]), Some(0xbeef));
        assert_eq!(vm.read_u64(writes[1]), Some(0xfeed));
        assert_eq!(vm.read_u64(writes[2]), Some(0xfeed));
        let s1: Vec<u64> = iter_ones(&vm.get_dirty_log(1).unwrap()).collect();
        let s7: Vec<u64> = iter_ones(&vm.get_dirty_log(7).unwrap()).collect();
        assert_eq!((s1, s7), (vec![0, 513], vec![255]), "{size:?}");
        // Logging off: writes are no longer recorded.
        vm.set_memslot_flags(1, 0).unwrap();
        vm.run_writes(0, &writes[..1], 1).unwrap();
        vm.set_memslot_flags(1, KVM_MEM_LOG_DIRTY_PAGES).unwrap();
        assert!(iter_ones(&vm.get_dirty_log(1).unwrap()).next().is_none());
        // Outside the window and overlapping slots are refused with a reason.
        let e = vm
            .add_memslot(2, TEST_MEM_GPA + (3 << 30), 4096, Backing::Anonymous, 0)
            .unwrap_err();
        assert!(e.to_string().contains("window"), "{e}");
        assert!(vm.add_memslot(1, far, 4096, Backing::Anonymous, 0).is_err());
    }
}

mod support;
use support::Needs;

fn main() -> std::process::ExitCode {
    support::run(&[
        (
            "guest_pages_2m_run_the_write_list_guest",
            Needs::Kvm,
            guest_pages_2m_run_the_write_list_guest,
        ),
        (
            "guest_pages_1g_run_the_write_list_guest",
            Needs::Kvm1GPages,
            guest_pages_1g_run_the_write_list_guest,
        ),
    ])
}
