// LD_PRELOAD fault shim. Env: FS_CALL=name (fsync,fdatasync,rename,renameat2,link,unlink,unlinkat,rmdir,close,write,pwrite,open,mkdir,read,pread,mmap)
// FS_N=first matching call to fail (1-based), FS_M=last (default FS_N; 0 = forever), FS_ERR=errno, FS_PATH=substring filter,
// FS_SHORT=1: write/pwrite do half the bytes instead of failing. FS_LOG=1 prints each matching call to stderr.
// FS_CLOSE_REAL=1: close really closes then reports error.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdarg.h>
#include <unistd.h>
#include <fcntl.h>
#include <sys/types.h>
#include <sys/mman.h>
#include <stdatomic.h>
static atomic_long counter;
static const char *want(void){ static const char *c; if(!c){ c=getenv("FS_CALL"); if(!c) c="";} return c; }
static int fdpath(int fd, char *buf, size_t n){ char p[64]; snprintf(p,64,"/proc/self/fd/%d",fd); ssize_t r=readlink(p,buf,n-1); if(r<0){buf[0]=0;return -1;} buf[r]=0; return 0; }
// returns 1 if should fail
static int hit(const char *name, const char *path){
  if(strcmp(want(),name)) return 0;
  const char *arm=getenv("FS_ARM"); if(arm && access(arm,F_OK)!=0) return 0;
  const char *f=getenv("FS_PATH"); if(f && *f && (!path || !strstr(path,f))) return 0;
  const char *eq=getenv("FS_PATHEQ"); if(eq && *eq && (!path || strcmp(path,eq))) return 0;
  long c=atomic_fetch_add(&counter,1)+1;
  long n=atol(getenv("FS_N")?getenv("FS_N"):"1");
  const char *ms=getenv("FS_M"); long m= ms? atol(ms): n;
  int fail = c>=n && (m==0 || c<=m);
  if(getenv("FS_LOG")) { char b[600]; int l=snprintf(b,600,"[shim] %s #%ld %s%s\n",name,c,path?path:"",fail?" -> FAIL":""); write(2,b,l); }
  return fail;
}
static int err(void){ return atoi(getenv("FS_ERR")?getenv("FS_ERR"):"5"); }
#define REAL(fn) static __typeof__(fn) *real_##fn; if(!real_##fn) real_##fn = dlsym(RTLD_NEXT, #fn)
int fsync(int fd){ REAL(fsync); char b[512]; fdpath(fd,b,512); if(hit("fsync",b)){errno=err();return -1;} return real_fsync(fd); }
int fdatasync(int fd){ REAL(fdatasync); char b[512]; fdpath(fd,b,512); if(hit("fdatasync",b)){errno=err();return -1;} return real_fdatasync(fd); }
int rename(const char *a,const char *b){ REAL(rename); if(hit("rename",a)){errno=err();return -1;} return real_rename(a,b); }
int renameat(int d1,const char *a,int d2,const char *b){ REAL(renameat); if(hit("rename",a)){errno=err();return -1;} return real_renameat(d1,a,d2,b); }
int renameat2(int d1,const char *a,int d2,const char *b,unsigned fl){ REAL(renameat2); if(fl && getenv("FS_NOEXCHANGE")){errno=EINVAL;return -1;} if(hit(fl?"renameat2":"rename",a)){errno=err();return -1;} return real_renameat2(d1,a,d2,b,fl); }
int link(const char *a,const char *b){ REAL(link); if(hit("link",a)){errno=err();return -1;} return real_link(a,b); }
int linkat(int d1,const char *a,int d2,const char *b,int fl){ REAL(linkat); if(hit("link",a)){errno=err();return -1;} return real_linkat(d1,a,d2,b,fl); }
int unlink(const char *a){ REAL(unlink); if(hit("unlink",a)){errno=err();return -1;} return real_unlink(a); }
int unlinkat(int d,const char *a,int fl){ REAL(unlinkat); char b[600]=""; if(d!=AT_FDCWD && a[0]!='/'){ fdpath(d,b,400); strcat(b,"/"); } strncat(b,a,190); if(hit((fl&AT_REMOVEDIR)?"rmdir":"unlink",b)){errno=err();return -1;} return real_unlinkat(d,a,fl); }
int rmdir(const char *a){ REAL(rmdir); if(hit("rmdir",a)){errno=err();return -1;} return real_rmdir(a); }
int close(int fd){ REAL(close); if(!strcmp(want(),"close")){ char b[512]; fdpath(fd,b,512); if(hit("close",b)){ real_close(fd); errno=err(); return -1;} } return real_close(fd); }
ssize_t write(int fd,const void *p,size_t n){ REAL(write); if(!strcmp(want(),"write")){ char b[512]; fdpath(fd,b,512); if(hit("write",b)){ if(getenv("FS_SHORT")&&n>1) return real_write(fd,p,n/2); errno=err(); return -1;} } return real_write(fd,p,n); }
ssize_t pwrite64(int fd,const void *p,size_t n,off_t o){ REAL(pwrite64); if(!strcmp(want(),"pwrite")){ char b[512]; fdpath(fd,b,512); if(hit("pwrite",b)){ if(getenv("FS_SHORT")&&n>1) return real_pwrite64(fd,p,n/2,o); errno=err(); return -1;} } return real_pwrite64(fd,p,n,o); }
ssize_t read(int fd,void *p,size_t n){ REAL(read); if(!strcmp(want(),"read")){ char b[512]; fdpath(fd,b,512); if(hit("read",b)){ if(getenv("FS_SHORT")&&n>1) return real_read(fd,p,n/2); errno=err(); return -1;} } return real_read(fd,p,n); }
ssize_t pread64(int fd,void *p,size_t n,off_t o){ REAL(pread64); if(!strcmp(want(),"pread")){ char b[512]; fdpath(fd,b,512); if(hit("pread",b)){ if(getenv("FS_SHORT")&&n>1) return real_pread64(fd,p,n/2,o); errno=err(); return -1;} } return real_pread64(fd,p,n,o); }
int mkdir(const char *a, mode_t m){ REAL(mkdir); if(hit("mkdir",a)){errno=err();return -1;} return real_mkdir(a,m); }
int mkdirat(int d,const char *a, mode_t m){ REAL(mkdirat); if(hit("mkdir",a)){errno=err();return -1;} return real_mkdirat(d,a,m); }
void *mmap64(void *addr,size_t len,int prot,int fl,int fd,off_t off){ REAL(mmap64); if(fd>=0 && !strcmp(want(),"mmap")){ char b[512]; fdpath(fd,b,512); if(hit("mmap",b)){errno=err();return MAP_FAILED;} } return real_mmap64(addr,len,prot,fl,fd,off); }
void *mmap(void *addr,size_t len,int prot,int fl,int fd,off_t off){ REAL(mmap); if(fd>=0 && !strcmp(want(),"mmap")){ char b[512]; fdpath(fd,b,512); if(hit("mmap",b)){errno=err();return MAP_FAILED;} } return real_mmap(addr,len,prot,fl,fd,off); }
static int do_open(const char *name,const char *path){ return hit(name,path); }
int open64(const char *p,int fl,...){ REAL(open64); mode_t m=0; if(fl&(O_CREAT|O_TMPFILE)){va_list a;va_start(a,fl);m=va_arg(a,int);va_end(a);} if(!strcmp(want(),"open")&&do_open("open",p)){errno=err();return -1;} return real_open64(p,fl,m); }
int open(const char *p,int fl,...){ REAL(open); mode_t m=0; if(fl&(O_CREAT|O_TMPFILE)){va_list a;va_start(a,fl);m=va_arg(a,int);va_end(a);} if(!strcmp(want(),"open")&&do_open("open",p)){errno=err();return -1;} return real_open(p,fl,m); }
int openat64(int d,const char *p,int fl,...){ REAL(openat64); mode_t m=0; if(fl&(O_CREAT|O_TMPFILE)){va_list a;va_start(a,fl);m=va_arg(a,int);va_end(a);} if(!strcmp(want(),"open")&&do_open("open",p)){errno=err();return -1;} return real_openat64(d,p,fl,m); }
int openat(int d,const char *p,int fl,...){ REAL(openat); mode_t m=0; if(fl&(O_CREAT|O_TMPFILE)){va_list a;va_start(a,fl);m=va_arg(a,int);va_end(a);} if(!strcmp(want(),"open")&&do_open("open",p)){errno=err();return -1;} return real_openat(d,p,fl,m); }
