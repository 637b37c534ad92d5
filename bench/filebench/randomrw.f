# filebench randomrw (random 8 KiB reads and writes on one 1 GiB file), sized for a small test
# machine.
# Run:  sed "s|\$MOUNTDIR|/mnt/rackfs|; s|\$RUNTIME|60|" bench/filebench/randomrw.f > /tmp/rr.f && filebench -f /tmp/rr.f
set $dir=$MOUNTDIR
set $filesize=1g
set $iosize=8k
set $nthreads=2
set $runtime=$RUNTIME

define file name=largefile1,path=$dir,size=$filesize,prealloc,reuse,paralloc

define process name=rand-rw,instances=1
{
  thread name=rand-r-thread,memsize=5m,instances=$nthreads
  {
    flowop read name=rand-read1,filename=largefile1,iosize=$iosize,random
  }
  thread name=rand-w-thread,memsize=5m,instances=$nthreads
  {
    flowop write name=rand-write1,filename=largefile1,iosize=$iosize,random
  }
}

run $runtime
